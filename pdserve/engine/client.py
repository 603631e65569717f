"""The engine as a server sees it: `EngineClient` (its messages: engine/messages.py).

A node's HTTP layer talks to its engine only through this interface: check a request, add it and
read its stream of outputs (closing the stream aborts it), ask for the latest stats snapshot
(published by the engine after every step) and the prefix cache's KV events, and read what is
fixed once the engine is built (`EngineInfo`). It never reads scheduler state itself, so the
engine can run on a thread of the server's process today (`ThreadedEngineClient`) and in its own
process later (as vLLM's EngineCore and mini-sglang's scheduler process do) without the server
changing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncIterator

from pdserve.engine.messages import CheckedRequest, EngineInfo, EngineStats, RequestOutput
from pdserve.kv.events import KVEventPage, KVSnapshot
from pdserve.kv.params import KVTransferParams
from pdserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    pass


class EngineClient(ABC):
    info: EngineInfo

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None:
        """Abort whatever is left and stop the engine."""

    @property
    @abstractmethod
    def healthy(self) -> bool: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def kv_events(self, after: int) -> KVEventPage:
        """The prefix cache's event batches after batch `after` (kv/events.py: KVEventLog.page)."""

    @abstractmethod
    def release_kv_hold(self, request_id: str) -> bool:
        """P: free the KV held for request_id (no D will pull it); False if none is held."""

    @abstractmethod
    def kv_snapshot(self) -> KVSnapshot:
        """Every block hash the prefix cache holds now."""

    @abstractmethod
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids; InvalidParameter if the prompt is empty or does not fit."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool,
                            tools: list[dict] | None = None) -> str: ...

    @abstractmethod
    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included), as logprobs name tokens."""

    @abstractmethod
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      kv_transfer_params: KVTransferParams | None = None) -> CheckedRequest:
        """The request as the engine accepts it (prompt ids from `tokenize`); InvalidParameter for
        what only the model can say (vocabulary, structured output that does not compile) and for
        kv_transfer_params this node cannot act on. The engine checks nothing again."""

    @abstractmethod
    def generate(self, request_id: str, request: CheckedRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes (for n > 1, the n sequences' outputs interleaved,
        told apart by `index`); closing the iterator early aborts the request."""
