"""A simulated node's prefix cache, block by block as BlockManager keeps it."""

from __future__ import annotations

import itertools
from collections import OrderedDict


class PrefixCache:
    """BlockManager's prefix cache, block by block: a block is known by its hash once a job has
    computed it full (and no other block holds that hash), by a negative id before. Free blocks are
    handed out as the engine's free list hands them out: never-used ones first, then the least
    recently freed (a job's tail first), which evicts the hash a freed block still held."""

    def __init__(self, num_blocks: int) -> None:
        self.untouched = num_blocks
        self.freed: OrderedDict[int, None] = OrderedDict()
        self.held: dict[int, int] = {}  # hash -> jobs holding its block
        self.hashes: set[int] = set()  # every hash a block holds, in use or free (the proxy's index reads it)
        self._ids = itertools.count(-1, -1)

    def match(self, hashes: list[int], limit: int) -> list[int]:
        """The leading hashes cached, at most `limit` (the engine always computes a prompt's last token)."""
        hit = []
        for h in hashes[:limit]:
            if h not in self.hashes:
                break
            hit.append(h)
        return hit

    def reusable(self, prefix: list[int]) -> int:
        """Blocks of `prefix` now free: taking them shrinks the free count."""
        return sum(1 for h in prefix if h not in self.held)

    def take(self, prefix: list[int]) -> None:
        for h in prefix:
            if h in self.held:
                self.held[h] += 1
            else:
                del self.freed[h]
                self.held[h] = 1

    def hand_out(self, n: int) -> list[int]:
        keys = []
        for _ in range(n):
            if self.untouched:
                self.untouched -= 1
            else:
                key, _ = self.freed.popitem(last=False)
                if key >= 0:  # a cached block handed out again: its prefix is gone
                    self.hashes.discard(key)
            keys.append(next(self._ids))
        return keys

    def publish(self, keys: list[int], hashes: list[int], start: int, end: int) -> None:
        """File blocks start..end of a job (BlockManager.cache_full_blocks)."""
        for i in range(start, end):
            h = hashes[i]
            if keys[i] < 0 and h not in self.hashes:
                keys[i] = h
                self.held[h] = 1
                self.hashes.add(h)

    def give_back(self, keys: list[int]) -> int:
        """A job's blocks, tail first; returns how many became free (shared ones stay held)."""
        freed = 0
        for key in reversed(keys):
            if key >= 0:
                left = self.held[key] - 1
                if left:
                    self.held[key] = left
                    continue
                del self.held[key]
            self.freed[key] = None
            freed += 1
        return freed
