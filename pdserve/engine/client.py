"""The engine as a server sees it: `EngineClient`.

A node's HTTP layer talks to its engine only through this interface: add a request and read its
stream of outputs (closing the stream aborts it), ask for the latest stats snapshot (published by
the engine after every step) and the prefix cache's KV events, and read what is fixed once the engine is built (`EngineInfo`). It
never reads scheduler state itself, so the engine can run on a thread of the server's process
today (`ThreadedEngineClient`) and in its own process later (as vLLM's EngineCore and
mini-sglang's scheduler process do) without the server changing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator

from pdserve.engine.request import RequestOutput
from pdserve.kv.events import KVEventPage, KVSnapshot
from pdserve.kv.params import KVTransferParams
from pdserve.kv.stats import KVStatsSnapshot
from pdserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineInfo:
    """What is fixed once the engine is built."""

    max_model_len: int
    kv_blocks_total: int
    engine_labels: dict[str, str]  # device, device_name, isa, dtype, kernels, quantization, attention (pdserve:engine_info)
    vocab_size: int
    template_knows_tools: bool = False  # the chat template renders `tools` itself


@dataclass(frozen=True)
class DecodeSteps:
    """Steps that only decoded, summed since start: how long they took and what they held. The proxy
    (auto mode) divides the time by its profile's prediction for these batches: the node's speed now."""

    steps: int = 0
    seconds: float = 0.0
    seqs: int = 0
    kv_tokens: int = 0  # each sequence's tokens, the one fed that step included


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after its latest step."""

    num_running: int = 0
    num_waiting: int = 0
    num_loading: int = 0  # D: waiting for KV from a prefill node
    kv_blocks_used: int = 0
    kv_blocks_held: int = 0  # P: held for a decode node to pull
    kv: KVStatsSnapshot = field(default_factory=KVStatsSnapshot)  # transfer counters
    decode: DecodeSteps = field(default_factory=DecodeSteps)


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
    def check_params(self, params: SamplingParams) -> None:
        """InvalidParameter for what only the model can say (vocabulary, structured output that does not compile)."""

    @abstractmethod
    def check_kv_transfer_params(self, params: KVTransferParams | None, num_prompt_tokens: int) -> None:
        """InvalidParameter if this node cannot act on the proxy's kv_transfer_params."""

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 kv_transfer_params: KVTransferParams | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes (for n > 1, the n sequences' outputs interleaved,
        told apart by `index`); closing the iterator early aborts the request."""
