"""What crosses the engine's face (engine/client.py): a checked request in; its outputs, the
engine's fixed facts and its state after each step out. Plain data, no engine internals: the node
server imports these and `EngineClient`, nothing else of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kv.params import KVTransferParams
from pdserve.kv.stats import KVStatsSnapshot
from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class CheckedRequest:
    """A request the engine has checked (its prompt tokenized and in range, its params valid for
    this model, its kv_transfer_params actionable here): what the engine's step loop accepts."""

    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely tokens and their logprobs, most likely first
    rank: int = 1  # 1 + how many tokens were more likely (vLLM's prompt_logprobs report it)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # wall time of each output token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_remote_tokens: int = 0  # prompt tokens whose KV was loaded from a prefill node
    kv_load_seconds: float = 0.0  # time spent waiting for remote KV
    kv_bytes: int = 0  # the remote KV's bytes, as this end moved them
    kv_blocks: int = 0  # the blocks they filled (per KV group)
    kv_transport: str | None = None  # the transport that moved them
    num_preemptions: int = 0
    # Prompt tokens computed, by every request, in the steps that computed this one's prompt (its own
    # included): prompts prefilled together share those steps, and each one's TTFT counts all of them.
    prefill_step_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_seconds(self) -> float:
        """Time waiting before the scheduler first took it (all of it while never scheduled)."""
        return (self.first_scheduled_time or self.arrival_time) - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at its end)."""

    request_id: str  # the client's id (for n > 1, every sequence's)
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop strings and special tokens removed)
    new_token_ids: list[int]
    text_delta: str  # text to stream now; a possible stop-string prefix is held back
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    kv_transfer_params: KVTransferParams | None = None  # P: where D can pull this request's KV
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # of every output token so far, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # of every prompt token (the first: None), when asked for
    index: int = 0  # which of the request's n sequences (OpenAI's choice index)


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

    def counters(self) -> dict[str, float]:
        """These sums under the names of the node's /metrics counters (pdserve:<name>_total)."""
        return {"decode_steps": self.steps, "decode_step_seconds": self.seconds, "decode_step_seqs": self.seqs,
                "decode_step_kv_tokens": self.kv_tokens}


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
    busy_seconds: float = 0.0  # time in steps that computed something, since start
    # The engine thread's CPU time in those steps (with one torch thread, all their compute): the
    # rest of busy_seconds is time other threads or processes held its core.
    busy_cpu_seconds: float = 0.0
