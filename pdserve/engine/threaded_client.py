"""`ThreadedEngineClient`: the engine's step loop on a thread of the server's process.

torch releases the GIL inside its kernels, so the HTTP event loop stays responsive while a step
runs. Requests and aborts reach the loop thread through a queue; outputs come back to each
request's asyncio.Queue with `call_soon_threadsafe`; after every step the loop publishes the
engine's stats snapshot, which the server reads instead of the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from pdserve.engine.client import EngineClient, EngineDeadError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.messages import CheckedRequest, EngineStats, RequestOutput
from pdserve.kv.events import KVEventPage, KVSnapshot
from pdserve.kv.params import KVTransferParams
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0
TRANSFER_POLL_S = 0.002


@dataclass
class _Add:
    request_id: str
    request: CheckedRequest
    arrival_time: float = field(default_factory=time.perf_counter)  # counts the wait for a step to end


@dataclass
class _Abort:
    request_id: str


class _Stream:
    """Delivers one request's outputs from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class ThreadedEngineClient(EngineClient):
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.info = engine.info()
        self.on_step = on_step  # called on the engine thread after every step (metrics)
        self._stats = engine.stats()
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Abort whatever is left and stop the loop thread."""
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self._error is None and self.engine.ranks_alive()

    def stats(self) -> EngineStats:
        # Transfer counters move between steps (side-channel threads): read them now.
        return replace(self._stats, kv=self.engine.transfer_stats())

    def kv_events(self, after: int) -> KVEventPage:
        return self.engine.kv_event_page(after)

    def kv_snapshot(self) -> KVSnapshot:
        return self.engine.kv_snapshot()

    # Tokenizing and checking run on the caller's thread: they read only what is fixed at start.

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize_prompt(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool,
                            tools: list[dict] | None = None) -> str:
        return self.engine.apply_chat_template(messages, add_generation_prompt, tools)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return self.engine.token_texts(token_ids)

    def release_kv_hold(self, request_id: str) -> bool:
        return self.engine.release_kv_hold(request_id)  # (thread-safe: the holds have their lock)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      kv_transfer_params: KVTransferParams | None = None) -> CheckedRequest:
        return self.engine.check_request(prompt_token_ids, params, kv_transfer_params)

    async def generate(self, request_id: str, request: CheckedRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (of all its n sequences) until it finishes; leaving early aborts it."""
        if not self.healthy:
            raise EngineDeadError(f"engine loop is not running: {self._error!r}")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._commands.put(_Add(request_id, request))
        n = request.params.n
        finished: set[int] = set()  # the indices of the n sequences that have finished
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished.add(item.index)
                yield item
                if len(finished) == n:
                    return
        finally:
            self._streams.pop(request_id, None)
            if len(finished) < n:
                self._commands.put(_Abort(request_id))

    # -- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                # Block for new work when idle; poll briefly while only KV transfers are pending.
                if self.engine.has_runnable_requests():
                    wait = 0.0
                else:
                    wait = TRANSFER_POLL_S if self.engine.has_unfinished_requests() else IDLE_WAIT_S
                if not self._drain_commands(wait):
                    break
                if self.engine.has_unfinished_requests():
                    # P's first token of a prompt whose KV just arrived streams now, not after the
                    # model run of the step that follows (a decode step of TTFT, idle or not)
                    arrived = self.engine.take_kv_transfers()
                    if arrived:
                        self._publish(arrived)
                    self._publish(self.engine.step())
        except BaseException as exc:  # the engine is broken: fail every waiting request
            logger.exception("engine loop died")
            self._error = exc
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"engine failed: {exc!r}"))
        finally:
            self.engine.abort_all()
            self.engine.close()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        # Stats and metrics before the outputs: a client that has its answer sees its effect
        self._stats = self.engine.stats()
        if self.on_step is not None:
            self.on_step(outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _drain_commands(self, wait: float) -> bool:
        """Apply queued adds and aborts, waiting up to `wait` s for the first; False once asked to stop."""
        applied = False
        while True:
            try:
                cmd = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            if cmd is None:
                return False
            applied = True
            if isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
                continue
            stream = self._streams.get(cmd.request_id)
            if stream is None:  # the client left before the request reached the engine
                continue
            try:
                self.engine.add(cmd.request, cmd.request_id, cmd.arrival_time)
            except ValueError as exc:
                stream.put(exc)
        if applied:  # publish now: the requests just added are waiting, the aborted ones gone
            self._stats = self.engine.stats()
        return True
