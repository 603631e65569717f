"""The paged block manager on its own: allocation, reference counts, prefix hits, eviction."""

from __future__ import annotations

from helpers import make_request

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request


def compute(bm: BlockManager, req: Request, n: int) -> None:
    """Allocate for n more tokens and mark them computed, as a scheduler step would."""
    assert bm.allocate(req, n)
    req.num_computed_tokens += n
    bm.cache_full_blocks(req)


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(list(range(10)))
    compute(bm, req, 10)
    assert len(req.block_ids) == 3 and bm.num_used_blocks == 3
    bm.free(req)
    assert bm.num_used_blocks == 0 and req.block_ids == []


def test_allocation_refused_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request(list(range(12)))
    assert not bm.allocate(req, 12)
    assert bm.num_used_blocks == 0 and req.block_ids == []


def test_prefix_hit_shares_blocks_with_refcount():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(list(range(10)), "a")
    compute(bm, a, 10)
    b = make_request(list(range(9)) + [99], "b")
    hits = bm.match_prefix(b)
    assert hits == a.block_ids[:2]  # two full blocks in common; the third differs
    assert bm.allocate(b, 2, hits)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert bm.ref_counts[a.block_ids[0]] == 2
    bm.free(a)
    assert bm.ref_counts[b.block_ids[0]] == 1 and bm.num_used_blocks == 3


def test_full_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(list(range(8)), "a")
    compute(bm, a, 8)
    b = make_request(list(range(8)), "b")
    assert len(bm.match_prefix(b)) == 1  # the last block is recomputed to produce logits


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request(list(range(8)), "a")
    compute(bm, a, 8)
    blocks = list(a.block_ids)
    bm.free(a)
    b = make_request(list(range(8)) + [5], "b")
    assert bm.match_prefix(b) == blocks
    c = make_request([7] * 12, "c")  # takes every block: the cached prefix is evicted
    compute(bm, c, 12)
    bm.free(c)
    assert bm.match_prefix(make_request(list(range(8)) + [5], "d")) == []


def test_no_prefix_reuse_when_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request(list(range(10)), "a")
    compute(bm, a, 10)
    assert bm.match_prefix(make_request(list(range(10)), "b")) == []
