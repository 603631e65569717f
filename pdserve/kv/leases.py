"""D's lease renewals: keep P's holds alive for the requests D has admitted and not yet pulled.

From admission (queued behind other work included) until its load ends or the request is dropped,
D renews each such request's hold on its P every third of P's lease, one `Renew` per P for all of
that P's requests, each P on a worker of its own (a P that hangs or is gone costs only its own
renewals a connect timeout). A D that dies stops renewing, and P frees the blocks a lease later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.kv.channel import connect
from pdserve.kv.protocol import Ack, ProtocolError, Renew, recv_msg, send_msg

logger = logging.getLogger(__name__)

RENEWALS_PER_LEASE = 3  # heartbeats per lease: two may be lost before the hold expires
RENEWAL_WORKERS = 8  # P nodes renewed at once; more wait for a free worker


@dataclass
class Lease:
    """A request admitted on D whose KV P holds for it."""

    request_id: str  # D's
    remote_request_id: str  # P's
    remote_host: str
    remote_port: int
    lease_s: float  # P's


class LeaseRenewer:
    """A thread that sends the tracked requests' renewals to their P nodes, one P per worker."""

    def __init__(self, timeout_s: float, secret: bytes = b"", tick_s: float = 0.25) -> None:
        self.timeout_s, self.secret, self.tick_s = timeout_s, secret, tick_s
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[Lease, float]] = {}  # D's request id -> (lease, next renewal)
        self._in_flight: set[tuple[str, int]] = set()  # P addresses a worker is renewing now
        self._workers = ThreadPoolExecutor(RENEWAL_WORKERS, thread_name_prefix="kv-lease-renew")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-lease", daemon=True)
        self._thread.start()

    def track(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.request_id] = (lease, time.monotonic() + lease.lease_s / RENEWALS_PER_LEASE)

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._leases.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _due(self) -> dict[tuple[str, int], list[str]]:
        """P's request ids to renew now, by P's side channel address; a P still being renewed waits
        for the next tick (its requests stay due), so one slow P never holds two workers."""
        now, due = time.monotonic(), defaultdict(list)
        with self._lock:
            for rid, (lease, at) in self._leases.items():
                address = (lease.remote_host, lease.remote_port)
                if now >= at and address not in self._in_flight:
                    due[address].append(lease.remote_request_id)
                    self._leases[rid] = (lease, now + lease.lease_s / RENEWALS_PER_LEASE)
            self._in_flight.update(due)
        return due

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            for (host, port), request_ids in self._due().items():
                self._workers.submit(self._renew, host, port, request_ids)

    def _renew(self, host: str, port: int, request_ids: list[str]) -> None:
        try:
            with connect(host, port, self.timeout_s, self.secret) as sock:
                send_msg(sock, Renew(request_ids))
                if not isinstance(recv_msg(sock), Ack):
                    raise ProtocolError("P did not acknowledge the renewal")
        except (OSError, ProtocolError) as exc:  # P gone or busy: the pull reports the failure, if any
            logger.info("renewing %d leases on %s:%s failed: %s", len(request_ids), host, port, exc)
        finally:
            with self._lock:
                self._in_flight.discard((host, port))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._workers.shutdown(wait=False, cancel_futures=True)
