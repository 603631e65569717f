"""KV events: what a node's prefix cache holds, published for the proxy's routing.

The block manager reports each block it files under a hash (stored) and each cached block it
hands out again (removed); the engine closes a batch of them after every step. A node serves the
batches to a subscriber that long-polls for the ones after the last it has (`GET
/kv/events?after=SEQ`), and what it holds now as a snapshot (`GET /kv/snapshot`). Batches are
numbered within an epoch, a fresh one each time a node starts, so a subscriber that sees a gap in
the numbers or another epoch knows its copy is stale and loads the snapshot again (resync). The
log keeps the latest batches only; a subscriber too far behind gets a gap, not an error.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque

import msgspec

MAX_BATCHES = 4096  # batches kept for subscribers that fall behind


class KVEventBatch(msgspec.Struct, frozen=True):
    """One engine step's changes to the prefix cache. Apply `removed` before `stored`: a step
    evicts while it schedules and files blocks once computed, so a hash evicted and filed again
    in one step is held at its end."""

    epoch: str
    seq: int
    stored: list[int]
    removed: list[int]


class KVEventPage(msgspec.Struct, frozen=True):
    """An answer to `GET /kv/events?after=SEQ`: the node's epoch, its latest batch number, and the
    batches after SEQ it still keeps."""

    epoch: str
    seq: int
    batches: list[KVEventBatch]


class KVSnapshot(msgspec.Struct, frozen=True):
    """Every block hash a node's prefix cache holds, as of batch `seq` of `epoch`."""

    epoch: str
    seq: int
    block_size: int
    hashes: list[int]


class KVEventLog:
    """Written by the engine's thread (stored, removed, close_batch), read by the server's (page,
    snapshot): what both touch (the batches, the held set, the number) is behind the lock; the
    step's pending lists are the engine thread's alone."""

    def __init__(self, block_size: int, max_batches: int = MAX_BATCHES) -> None:
        self.block_size = block_size
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._seq = 0
        self._held: set[int] = set()
        self._stored: list[int] = []
        self._removed: list[int] = []

    def stored(self, block_hash: int) -> None:
        self._stored.append(block_hash)

    def removed(self, block_hash: int) -> None:
        self._removed.append(block_hash)

    def close_batch(self) -> None:
        """End of an engine step: what it stored and removed becomes the next numbered batch."""
        if not (self._stored or self._removed):
            return
        with self._lock:
            self._seq += 1
            batch = KVEventBatch(epoch=self.epoch, seq=self._seq, stored=self._stored, removed=self._removed)
            self._held.difference_update(batch.removed)
            self._held.update(batch.stored)
            self._batches.append(batch)
            self._stored, self._removed = [], []

    def page(self, after: int) -> KVEventPage:
        """The batches after `after` still kept (the first may not be after + 1: a gap), with the
        latest number, read together."""
        with self._lock:
            first = self._batches[0].seq if self._batches else self._seq + 1
            batches = list(self._batches)[max(after + 1 - first, 0):] if self._seq > after else []
            return KVEventPage(epoch=self.epoch, seq=self._seq, batches=batches)

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(epoch=self.epoch, seq=self._seq, block_size=self.block_size, hashes=sorted(self._held))
