"""Counters of KV transfers, added to from transfer threads and the engine thread; read as a snapshot."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace


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
    # (direction "sent" | "received", transport) -> (bytes, seconds): the totals above by transport
    by_transport: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)


class KVStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = KVStatsSnapshot()

    def _add(self, moved: tuple[str, str, int, float] | None = None, **deltas: float) -> None:
        with self._lock:
            counts = self._counts
            changes = {k: getattr(counts, k) + v for k, v in deltas.items()}
            if moved is not None:  # (direction, transport, bytes, seconds)
                direction, transport, nbytes, seconds = moved
                old_bytes, old_seconds = counts.by_transport.get((direction, transport), (0, 0.0))
                changes["by_transport"] = {**counts.by_transport,
                                           (direction, transport): (old_bytes + nbytes, old_seconds + seconds)}
            self._counts = replace(counts, **changes)

    def add_sent(self, nbytes: int, seconds: float, transport: str) -> None:
        self._add(("sent", transport, nbytes, seconds), bytes_sent=nbytes, send_seconds=seconds)

    def add_received(self, nbytes: int, seconds: float, transport: str) -> None:
        self._add(("received", transport, nbytes, seconds), bytes_received=nbytes, receive_seconds=seconds,
                  transfers_received=1)

    def add_failed(self) -> None:
        self._add(transfers_failed=1)

    def add_hold_expired(self) -> None:
        self._add(holds_expired=1)

    def add_remote_tokens(self, n: int) -> None:
        self._add(remote_tokens=n)

    def snapshot(self) -> KVStatsSnapshot:
        return self._counts  # frozen: replaced whole under the lock, never changed in place
