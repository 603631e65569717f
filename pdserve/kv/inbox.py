"""D's finished transfers: loads (pull) and pushes end here, and the engine takes them each step."""

from __future__ import annotations

import queue
from dataclasses import dataclass


@dataclass
class TransferResult:
    """One request's KV transfer that ended on D: the engine resumes the request, or fails it."""

    request_id: str  # D's
    error: str | None
    mode: str  # pull | push
    transport: str | None = None  # None when it failed before one was agreed
    seconds: float = 0.0
    nbytes: int = 0
    first_token_id: int | None = None  # push: the first output token P sampled, sent with the push's end


class TransferInbox:
    """Put by transfer threads, polled by the engine thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()

    def put(self, result: TransferResult) -> None:
        self._queue.put(result)

    def poll(self, timeout: float = 0.0) -> list[TransferResult]:
        """Finished transfers; waits up to `timeout` seconds for the first one."""
        out = []
        while True:
            try:
                out.append(self._queue.get(timeout=timeout) if timeout and not out else self._queue.get_nowait())
            except queue.Empty:
                return out
