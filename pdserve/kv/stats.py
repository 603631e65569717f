"""Counters of KV transfers, added to from transfer threads and the engine thread; read as a snapshot."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVStatsSnapshot:
    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0
    transfers_received: int = 0
    transfers_failed: int = 0
    holds_expired: int = 0
    remote_tokens: int = 0  # prompt tokens whose KV came from a P (D side)


class KVStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = KVStatsSnapshot()

    def _add(self, **deltas: float) -> None:
        with self._lock:
            self._counts = replace(self._counts, **{k: getattr(self._counts, k) + v for k, v in deltas.items()})

    def add_sent(self, nbytes: int, seconds: float) -> None:
        self._add(bytes_sent=nbytes, send_seconds=seconds)

    def add_received(self, nbytes: int, seconds: float) -> None:
        self._add(bytes_received=nbytes, receive_seconds=seconds, transfers_received=1)

    def add_failed(self) -> None:
        self._add(transfers_failed=1)

    def add_hold_expired(self) -> None:
        self._add(holds_expired=1)

    def add_remote_tokens(self, n: int) -> None:
        self._add(remote_tokens=n)

    def snapshot(self) -> KVStatsSnapshot:
        return self._counts  # frozen: replaced whole under the lock, never changed in place
