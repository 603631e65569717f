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
    assert len(req.block_tables[0]) == 3 and bm.num_used_blocks == 3
    bm.free(req)
    assert bm.num_used_blocks == 0 and req.block_tables == []


def test_allocation_refused_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request(list(range(12)))
    assert not bm.allocate(req, 12)
    assert bm.num_used_blocks == 0 and not any(req.block_tables)


def test_prefix_hit_shares_blocks_with_refcount():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(list(range(10)), "a")
    compute(bm, a, 10)
    b = make_request(list(range(9)) + [99], "b")
    hits = bm.match_prefix(b)
    assert hits == [a.block_tables[0][:2]]  # two full blocks in common; the third differs (one KV group)
    assert bm.allocate(b, 2, hits)
    assert b.num_computed_tokens == 8 and b.block_tables[0][:2] == a.block_tables[0][:2]
    assert bm.ref_counts[a.block_tables[0][0]] == 2
    bm.free(a)
    assert bm.ref_counts[b.block_tables[0][0]] == 1 and bm.num_used_blocks == 3


def test_full_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(list(range(8)), "a")
    compute(bm, a, 8)
    b = make_request(list(range(8)), "b")
    assert len(bm.match_prefix(b)[0]) == 1  # the last block is recomputed to produce logits


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request(list(range(8)), "a")
    compute(bm, a, 8)
    blocks = list(a.block_tables[0])
    bm.free(a)
    b = make_request(list(range(8)) + [5], "b")
    assert bm.match_prefix(b) == [blocks]
    c = make_request([7] * 12, "c")  # takes every block: the cached prefix is evicted
    compute(bm, c, 12)
    bm.free(c)
    assert bm.match_prefix(make_request(list(range(8)) + [5], "d")) == []


def test_no_prefix_reuse_when_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request(list(range(10)), "a")
    compute(bm, a, 10)
    assert bm.match_prefix(make_request(list(range(10)), "b")) == []


# -- sliding-window groups: one full-attention group and one with a window of 8 tokens ------------

SLIDING = (0, 8)


def test_a_sliding_group_frees_its_blocks_as_they_leave_the_window():
    """Blocks of 4, window 8: at 25 computed tokens the next token reads positions 18..25, blocks
    4..6; the sliding table keeps those, the null block before them, and the pool has the rest."""
    bm = BlockManager(num_blocks=16, block_size=4, group_windows=SLIDING)
    assert bm.num_free_blocks == 15  # block 0 is the null block
    req = make_request(list(range(40)))
    compute(bm, req, 12)
    for _ in range(13):  # one token a step, as decodes
        compute(bm, req, 1)
    assert bm.allocate(req, 1)
    full, sliding = req.block_tables
    assert len(full) == 7 and 0 not in full
    assert sliding[:4] == [0] * 4 and 0 not in sliding[4:] and len(sliding) == 7
    assert bm.num_used_blocks == bm.num_held(req) == 7 + 3
    bm.free(req)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 15


def test_a_prefix_hit_needs_only_the_sliding_groups_window():
    """A finished request's sliding blocks left the window one by one but stay cached: a prompt
    with the same 24-token prefix takes the full group's 6 blocks and the sliding group's last 2
    (positions 17..23 are what token 24 reads), with the null block before them."""
    bm = BlockManager(num_blocks=32, block_size=4, group_windows=SLIDING)
    a = make_request(list(range(30)), "a")
    compute(bm, a, 8)
    for _ in range(22):
        compute(bm, a, 1)
    bm.free(a)
    b = make_request(list(range(24)) + [99, 98], "b")
    full, sliding = bm.match_prefix(b)
    assert len(full) == 6 and sliding[:4] == [0] * 4 and len(sliding) == 6 and 0 not in sliding[4:]
    assert bm.allocate(b, 2, [full, sliding])
    assert b.num_computed_tokens == 24 and b.block_tables[0][:6] == full


def test_no_prefix_hit_without_the_window_blocks():
    """The full group's blocks are cached but the sliding group's window blocks were evicted: no
    hit where the sliding layers could not continue, a shorter one where they can."""
    bm = BlockManager(num_blocks=32, block_size=4, group_windows=SLIDING)
    a = make_request(list(range(24)) + [1], "a")
    compute(bm, a, 25)
    sliding = a.block_tables[1]
    bm.free(a)
    for block in sliding[4:6]:  # the window of a 24-token hit: gone
        key = bm.block_hash[block]
        del bm.cached_blocks[key]
        bm.block_hash[block] = None
    hit = bm.match_prefix(make_request(list(range(24)) + [7, 7], "b"))
    assert len(hit[0]) == 4 and hit[1][:2] == [0, 0] and hit[1][2:] == sliding[2:4]


def test_a_load_reserves_only_the_window_of_a_sliding_group():
    """D reserving blocks for 100 loaded tokens: the full group all 25, the sliding group the 2
    its next token reads (positions 93..99)."""
    bm = BlockManager(num_blocks=64, block_size=4, group_windows=SLIDING)
    req = make_request(list(range(101)))
    assert bm.allocate(req, 100, loaded=True)
    full, sliding = req.block_tables
    assert len(full) == len(sliding) == 25 and sliding[:23] == [0] * 23 and 0 not in sliding[23:]
    assert bm.num_used_blocks == 25 + 2
