"""P's holds: finished prefills whose blocks wait for a decode node to pull them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdserve.kv.prefix_hash import prompt_digest


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    token_ids: list[int] | None  # the prompt the KV is of (None: a benchmark's bare blocks)
    pinned: int = 0
    done: bool = False


class HeldBlocks:
    """P's registry of finished requests whose blocks wait for a D (shared by engine and server)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}

    def hold(self, request_id: str, block_ids: list[int], token_ids: list[int] | None = None) -> None:
        with self._lock:
            # (the request's prompt list itself: a prompt never changes)
            self._holds[request_id] = _Hold(list(block_ids), time.monotonic() + self.timeout_s, token_ids)

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
        """(request id, expired) of holds whose blocks can be freed now: pulled, or expired and idle."""
        now, out = time.monotonic(), []
        with self._lock:
            for rid, h in list(self._holds.items()):
                if h.pinned:
                    continue
                if h.done or now > h.deadline:
                    out.append((rid, not h.done))
                    del self._holds[rid]
        return out

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())
