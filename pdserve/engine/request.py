"""A request's state inside the engine, and what the engine reports back for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar import GrammarMatcher
from pdserve.engine.logprobs import TokenLogprob
from pdserve.kv.params import KVTransferParams
from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # D node: blocks reserved, KV in flight
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; recomputed from scratch when rescheduled
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # wall time of each output token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_remote_tokens: int = 0  # prompt tokens whose KV was loaded from a prefill node
    kv_load_seconds: float = 0.0  # time spent waiting for remote KV
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        generator: torch.Generator | None,
        kv_transfer_params: KVTransferParams | None = None,
        arrival_time: float | None = None,
        client_id: str | None = None,
        index: int = 0,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.request_id = request_id  # unique in the engine; the first of n sequences has the client's id
        self.client_id = client_id if client_id is not None else request_id  # what its outputs are reported as
        self.index = index  # which of the client's n sequences this is
        self.grammar = grammar  # structured output: what may come next (engine/logits.py masks the rest)
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, the sequence the model sees
        self.params = params
        self.detokenizer = detokenizer
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_model_len = max_model_len
        self.generator = generator
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.num_published_blocks = 0  # leading blocks already in the prefix cache
        # Arrival is when the server got the request (it may wait for the engine's step to end).
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.perf_counter())
        # PD disaggregation: what the proxy asked (kv_transfer_params in), what P answers (out).
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_out: KVTransferParams | None = None
        self.kv_external_tokens = 0  # D: tokens being loaded from P right now
        self.error: str | None = None  # why the request failed, when it did
        self.logprobs: list[TokenLogprob] = []  # of each output token, when params.logprobs asks
        self.prompt_logprobs: list[TokenLogprob | None] = []  # of each prompt token (the first: None), when asked

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int, now: float) -> None:
        """Record a sampled token and finish the request if it hit a stop condition."""
        self.token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)
        self.detokenizer.add(token_id)
        refused = self.grammar.accept(token_id) if self.grammar is not None else None
        if refused is not None:  # cannot happen for a masked draw; end the request rather than the engine
            self.status, self.error = RequestStatus.FINISHED_ABORTED, f"structured output: {refused}"
        elif token_id in self.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif (self.params.stop and self.num_output_tokens >= self.params.min_tokens
              and self.detokenizer.truncate_at_stop(self.params.stop)):
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        elif self.grammar is not None and self.grammar.done:  # complete: nothing but the end may follow
            self.status = RequestStatus.FINISHED_STOPPED


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

    @classmethod
    def of(cls, req: Request, new_token_ids: list[int]) -> "RequestOutput":
        finished = req.status.finished
        return cls(
            request_id=req.client_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=req.detokenizer.text,
            new_token_ids=new_token_ids,
            text_delta=req.detokenizer.take_delta(req.params.max_stop_len, finished),
            finished=finished,
            finish_reason=req.status.finish_reason,
            metrics=req.metrics,
            kv_transfer_params=req.kv_transfer_params_out,
            error=req.error,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            index=req.index,
        )
