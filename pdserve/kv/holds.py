"""P's holds: finished prefills whose blocks wait for a decode node to pull them.

A hold is a lease (vLLM NIXL's design): it lasts `lease_s` from the prefill, and each `Renew` from
the decode node that admitted the request extends it to `lease_s` from then. A D that has the
request renews while it is queued there, so a short lease frees the blocks of requests nobody will
pull (the D died, the proxy gave up) soon, without cutting off a D that is merely busy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdserve import tracing
from pdserve.kv.prefix_hash import prompt_digest


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    token_ids: list[int] | None  # the prompt the KV is of (None: a benchmark's bare blocks)
    pinned: int = 0
    done: bool = False
    traceparent: str | None = None  # P's request span (tracing on): the hold ends as its kv.lease span
    since: float = 0.0  # perf_counter seconds
    renewals: int = 0


class HeldBlocks:
    """P's registry of finished requests whose blocks wait for a D (shared by engine and server)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}

    def hold(self, request_id: str, block_ids: list[int], token_ids: list[int] | None = None,
             traceparent: str | None = None) -> None:
        with self._lock:
            # (the request's prompt list itself: a prompt never changes)
            self._holds[request_id] = _Hold(list(block_ids), time.monotonic() + self.lease_s, token_ids,
                                            traceparent=traceparent, since=time.perf_counter())

    def pin(self, request_id: str, block_ids: list[int], num_tokens: int = 0, digest: int | None = None) -> str | None:
        """Reserve the hold for one transfer; an error message if the request may not be read: the
        hold is gone, the blocks are not its own, or (a hold of a prompt) the reader's prompt
        differs from it in its first `num_tokens` tokens (`digest`: prefix_hash.prompt_digest)."""
        with self._lock:
            h = self._holds.get(request_id)
            if h is None or h.done:
                return f"no KV held for request {request_id!r} (expired, already pulled, or unknown)"
            if time.monotonic() > h.deadline and not h.pinned:
                return f"KV hold of request {request_id!r} expired"
            if not set(block_ids) <= set(h.block_ids):
                return f"blocks requested are not held for request {request_id!r}"
            if h.token_ids is not None:
                if not 0 < num_tokens <= len(h.token_ids):
                    return (f"the KV held for request {request_id!r} covers {len(h.token_ids)} prompt tokens, "
                            f"not the {num_tokens} asked for")
                if digest != prompt_digest(h.token_ids, num_tokens):
                    return (f"the KV held for request {request_id!r} is of another prompt (its first {num_tokens} "
                            "tokens differ from the decode request's)")
            h.pinned += 1
            return None

    def renew(self, request_ids: list[str]) -> int:
        """Extend the named holds to a full lease from now; how many were still held."""
        deadline, renewed = time.monotonic() + self.lease_s, 0
        with self._lock:
            for rid in request_ids:
                h = self._holds.get(rid)
                if h is not None and not h.done:
                    h.deadline = max(h.deadline, deadline)
                    h.renewals += 1
                    renewed += 1
        return renewed

    def unpin(self, request_id: str, done: bool) -> None:
        with self._lock:
            h = self._holds.get(request_id)
            if h is not None:
                h.pinned -= 1
                h.done = h.done or done

    def release(self, request_id: str) -> bool:
        """D will never pull this request: its blocks are freed (once no pull is in progress)."""
        with self._lock:
            h = self._holds.get(request_id)
            if h is not None:
                h.done = True
            return h is not None

    def pop_releasable(self) -> list[tuple[str, bool]]:
        """(request id, expired) of holds whose blocks can be freed now: pulled, or expired and idle.

        Every hold is looked at (a reaper that stops at the first unexpired one strands the blocks
        behind it: vLLM #58222); the freed come in deadline order."""
        now, out, ended = time.monotonic(), [], []
        with self._lock:
            for rid, h in sorted(self._holds.items(), key=lambda item: item[1].deadline):
                if h.pinned:
                    continue
                if h.done or now > h.deadline:
                    out.append((rid, not h.done))
                    del self._holds[rid]
                    if h.traceparent is not None:
                        ended.append((rid, h))
        for rid, h in ended:  # (tracing on) the lease, from the prefill's end until its blocks were freed
            tracing.record("kv.lease", h.traceparent, rid, h.since, time.perf_counter(),
                           {"pdserve.kv.blocks": len(h.block_ids), "pdserve.kv.renewals": h.renewals,
                            "pdserve.kv.expired": not h.done})
        return out

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())
