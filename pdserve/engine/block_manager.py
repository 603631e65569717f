"""Paged KV blocks: allocation with reference counts, and hash-chained prefix caching.

A full block is identified by the hash of (hash of the previous block, its token ids), so equal
hashes mean equal prefixes. A freed block keeps its hash and contents until it is handed out
again (least recently freed first), so a later request with the same prefix can take it back.

A model with sliding-window layers has several KV groups (models/kv_spec.py), all drawing block ids
from this one pool: a request holds a table per group, and a sliding group's blocks go back to the
pool as they leave its window (their entries become NULL_BLOCK, which nothing reads). A prefix hit
then needs, of each sliding group, only the blocks its window still reads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from pdserve.engine.request import Request
from pdserve.kv.events import KVEventLog
from pdserve.kv.prefix_hash import block_hashes
from pdserve.models.kv_spec import NULL_BLOCKS, first_needed_block

NULL_BLOCK = 0  # with sliding groups: reserved, the table entry of a block before its window


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, group_windows: tuple[int, ...] = (0,)) -> None:
        self.num_blocks = num_blocks
        self.events = events  # told of every hash of the first group filed and dropped (the proxy's routing)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = group_windows  # each KV group's window (0: full attention)
        self.num_reserved = NULL_BLOCKS if any(group_windows) else 0
        self.one_full_group = tuple(group_windows) == (0,)  # allocate's fast path
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[tuple[int, int] | None] = [None] * num_blocks  # (group, hash)
        self.cached_blocks: dict[tuple[int, int], int] = {}  # (group, hash) -> block id
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_reserved, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_reserved - len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, group: int, num_tokens: int) -> int:
        """The first block `group` reads once num_tokens tokens are computed (0: all of them)."""
        return first_needed_block(self.group_windows[group], num_tokens, self.block_size)

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes over the full blocks among its first num_tokens tokens."""
        if len(req.block_hashes) < num_tokens // self.block_size:
            req.block_hashes = block_hashes(req.token_ids[:num_tokens], self.block_size, req.block_hashes)

    def _longest_prefix(self, most: int, has: Callable[[int, int], bool]) -> int:
        """The most leading blocks (<= most) every group can continue from: a full group holds all of
        them, a sliding group those its window reads at the next token. `has(group, i)`."""
        for g, window in enumerate(self.group_windows):
            if not window:
                run = 0
                while run < most and has(g, run):
                    run += 1
                most = run
        for k in range(most, 0, -1):
            if all(has(g, i) for g, window in enumerate(self.group_windows) if window
                   for i in range(self._first_needed(g, k * self.block_size), k)):
                return k
        return 0

    def _real(self, block: int) -> bool:
        """Not the null block (which only exists with sliding groups)."""
        return block != NULL_BLOCK or not self.num_reserved

    def _tables_up_to(self, k: int, block: Callable[[int, int], int]) -> list[list[int]]:
        """Each group's table of the first k blocks: NULL_BLOCK before what its window reads."""
        tables = []
        for g in range(len(self.group_windows)):
            first = self._first_needed(g, k * self.block_size)
            tables.append([NULL_BLOCK] * first + [block(g, i) for i in range(first, k)])
        return tables

    def match_prefix(self, req: Request) -> list[list[int]]:
        """Cached blocks holding a prefix of req, a table per group; at least one token is always
        left to compute. None for a request that asks for its prompt's logprobs: every prompt token
        is computed."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        hashes = req.block_hashes
        most = min(len(hashes), (req.num_tokens - 1) // self.block_size)  # hashes known ahead may reach further
        k = self._longest_prefix(most, lambda g, i: (g, hashes[i]) in self.cached_blocks)
        return self._tables_up_to(k, lambda g, i: self.cached_blocks[(g, hashes[i])]) if k else []

    def fork_prefix(self, first: Request, num_blocks: int) -> list[list[int]]:
        """Of `first`'s leading num_blocks blocks, the most a sibling can share (its sliding groups
        may have let some go), a table per group."""
        k = self._longest_prefix(num_blocks, lambda g, i: self._real(first.block_tables[g][i]))
        return self._tables_up_to(k, lambda g, i: first.block_tables[g][i]) if k else []

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[list[int]] = (), loaded: bool = False) -> bool:
        """Give req the cached prefix blocks (a table per group) plus enough new blocks for
        num_new_tokens more tokens. `loaded`: their KV arrives from elsewhere (a decode node's load),
        so none of them attends and a sliding group needs only what the next token reads."""
        if not req.block_tables:
            req.block_tables = [[] for _ in self.group_windows]
        if self.one_full_group and not prefix:  # the common case (every decode step): what the rest does, briefly
            table = req.block_tables[0]
            new = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
            if new > len(self.free_blocks):
                return False
            if new > 0:
                table.extend(self._fresh_blocks(new))
            return True
        hit = len(prefix[0]) if prefix else 0
        start = req.num_computed_tokens + hit * self.block_size
        end = start + num_new_tokens
        firsts = [self._first_needed(g, end if loaded else start) for g in range(len(self.group_windows))]
        for g, first in enumerate(firsts):  # blocks that left a sliding window go back to the pool
            table = req.block_tables[g]
            i = min(first, len(table)) - 1
            while i >= 0 and self._real(table[i]):  # what left earlier is null already: stop there
                self._release(table[i])
                table[i] = NULL_BLOCK
                i -= 1
        # The prefix's blocks each group keeps: those at or after its first needed one.
        kept = [[b if self._real(b) and i >= firsts[g] else None for i, b in enumerate(prefix[g], len(table))]
                for g, table in enumerate(req.block_tables)] if hit else []
        reusable_free = sum(1 for blocks in kept for b in blocks if b is not None and self.ref_counts[b] == 0)
        last = self.blocks_needed(end)
        new = [max(0, last - max(len(table) + hit, firsts[g])) for g, table in enumerate(req.block_tables)]
        if sum(new) > self.num_free_blocks - reusable_free:
            return False
        for g, table in enumerate(req.block_tables):
            for b in kept[g] if hit else ():
                if b is not None:
                    self._take(b)
                table.append(NULL_BLOCK if b is None else b)
            table.extend([NULL_BLOCK] * (firsts[g] - len(table)))
            table.extend(self._fresh_blocks(new[g]))
        req.num_computed_tokens += hit * self.block_size
        req.num_published_blocks += hit
        return True

    def _fresh_blocks(self, n: int) -> list[int]:
        """n blocks off the free list (least recently freed first), their cached contents evicted."""
        free, refs, hashes = self.free_blocks, self.ref_counts, self.block_hash
        blocks = []
        for _ in range(n):
            block, _ = free.popitem(last=False)
            key = hashes[block]
            if key is not None:  # evict its cached contents
                self.cached_blocks.pop(key, None)
                if self.events is not None and key[0] == 0:
                    self.events.removed(key[1])
                hashes[block] = None
            refs[block] = 1  # a free block has no references
            blocks.append(block)
        return blocks

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.free_blocks.pop(block, None)
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def cache_full_blocks(self, req: Request) -> None:
        """Publish req's newly computed full blocks for prefix reuse (every group's that it holds)."""
        num_full = req.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= req.num_published_blocks:
            return  # (most steps: no block filled since)
        self._update_hashes(req, req.num_computed_tokens)
        for i in range(req.num_published_blocks, num_full):
            h = req.block_hashes[i]
            for g, table in enumerate(req.block_tables):
                block = table[i]
                if not self._real(block):
                    continue  # a sliding group's block it never held (a load skips what the window left)
                if self.block_hash[block] is None and (g, h) not in self.cached_blocks:
                    self.block_hash[block] = (g, h)
                    self.cached_blocks[(g, h)] = block
                    if self.events is not None and g == 0:
                        self.events.stored(h)
        req.num_published_blocks = max(req.num_published_blocks, num_full)

    def num_held(self, req: Request) -> int:
        """Blocks req holds, over all its groups."""
        return sum(1 for table in req.block_tables for b in table if self._real(b))

    def free(self, req: Request) -> None:
        # Tail blocks go back first, so they are also evicted first: prefixes live longest.
        refs, free = self.ref_counts, self.free_blocks
        for table in req.block_tables:
            for block in reversed(table):
                if block != NULL_BLOCK or not self.num_reserved:  # _real, inline: every block of a request passes here
                    refs[block] -= 1
                    if not refs[block]:
                        free[block] = None
        req.block_tables = []
        req.num_published_blocks = 0
