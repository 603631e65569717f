"""Counters of KV transfers, updated from transfer threads and read by the metrics endpoint."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class KVStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0
    transfers_received: int = 0
    transfers_failed: int = 0
    holds_expired: int = 0
    remote_tokens: int = 0  # prompt tokens whose KV came from a P (D side)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_sent(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.send_seconds += seconds

    def add_received(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.receive_seconds += seconds
            self.transfers_received += 1

    def add_failed(self) -> None:
        with self._lock:
            self.transfers_failed += 1
