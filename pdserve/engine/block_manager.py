"""Paged KV blocks: allocation with reference counts, and hash-chained prefix caching.

A full block is identified by the hash of (hash of the previous block, its token ids), so equal
hashes mean equal prefixes. A freed block keeps its hash and contents until it is handed out
again (least recently freed first), so a later request with the same prefix can take it back.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.engine.request import Request
from pdserve.kv.events import KVEventLog
from pdserve.kv.prefix_hash import block_hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None) -> None:
        self.num_blocks = num_blocks
        self.events = events  # told of every hash filed and dropped (the proxy's routing reads them)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached_blocks: dict[int, int] = {}  # hash -> block id
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes over the full blocks among its first num_tokens tokens."""
        if len(req.block_hashes) < num_tokens // self.block_size:
            req.block_hashes = block_hashes(req.token_ids[:num_tokens], self.block_size, req.block_hashes)

    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding a prefix of req; at least one token is always left to compute.
        None for a request that asks for its prompt's logprobs: every prompt token is computed."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        hits = []
        for h in req.block_hashes:
            block = self.cached_blocks.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, prefix_blocks: list[int] = ()) -> bool:
        """Give req the cached prefix blocks plus enough new blocks for num_new_tokens more tokens."""
        total = req.num_computed_tokens + len(prefix_blocks) * self.block_size + num_new_tokens
        reusable_free = sum(1 for b in prefix_blocks if self.ref_counts[b] == 0)
        new_needed = self.blocks_needed(total) - len(req.block_ids) - len(prefix_blocks)
        if new_needed > self.num_free_blocks - reusable_free:
            return False
        for b in prefix_blocks:
            self._take(b)
        req.block_ids.extend(prefix_blocks)
        req.num_computed_tokens += len(prefix_blocks) * self.block_size
        req.num_published_blocks += len(prefix_blocks)
        for _ in range(max(new_needed, 0)):
            block, _ = self.free_blocks.popitem(last=False)
            if self.block_hash[block] is not None:  # evict its cached contents
                self.cached_blocks.pop(self.block_hash[block], None)
                if self.events is not None:
                    self.events.removed(self.block_hash[block])
                self.block_hash[block] = None
            self._take(block)
            req.block_ids.append(block)
        return True

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.free_blocks.pop(block, None)
        self.ref_counts[block] += 1

    def cache_full_blocks(self, req: Request) -> None:
        """Publish req's newly computed full blocks for prefix reuse."""
        if not self.enable_prefix_caching or not req.prefix_cacheable:
            return
        num_full = req.num_computed_tokens // self.block_size
        self._update_hashes(req, req.num_computed_tokens)
        for i in range(req.num_published_blocks, num_full):
            block, h = req.block_ids[i], req.block_hashes[i]
            if self.block_hash[block] is None and h not in self.cached_blocks:
                self.block_hash[block] = h
                self.cached_blocks[h] = block
                if self.events is not None:
                    self.events.stored(h)
        req.num_published_blocks = max(req.num_published_blocks, num_full)

    def free(self, req: Request) -> None:
        # Tail blocks go back first, so they are also evicted first: prefixes live longest.
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        req.block_ids = []
        req.num_published_blocks = 0
