"""A request's state inside the engine; `output()` is what the engine reports back for it."""

from __future__ import annotations

import enum
import time

import torch

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar import GrammarMatcher
from pdserve.engine.messages import RequestMetrics, RequestOutput, TokenLogprob
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
        return self._reason is not None

    @property
    def finish_reason(self) -> str | None:
        return self._reason


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}
for _status in RequestStatus:  # an attribute of each member: looking one up in a dict hashed the enum in
    _status._reason = _FINISH_REASONS.get(_status)  # Python (a simulator asks millions of times)


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
        self.num_prompt_tokens = len(self.prompt_token_ids)  # (the prompt never changes)
        self.token_ids = list(prompt_token_ids)  # prompt + output, the sequence the model sees
        self.params = params
        self.detokenizer = detokenizer
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stop_holdback = params.max_stop_len  # text held back from streaming: a stop string may begin there
        self.max_model_len = max_model_len
        self.generator = generator
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # One block table per KV group (models/kv_spec.py), block i of the sequence at index i; a
        # sliding group's blocks before its window are NULL_BLOCK. Empty while it holds no blocks.
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.num_published_blocks = 0  # leading blocks already in the prefix cache
        # Arrival is when the server got the request (it may wait for the engine's step to end).
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.perf_counter())
        # PD disaggregation: what the proxy asked (kv_transfer_params in), what P answers (out).
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_out: KVTransferParams | None = None
        self.kv_external_tokens = 0  # D: tokens being loaded from P right now
        self.error: str | None = None  # why the request failed, when it did
        # D: P's first token, appended but not yet streamed, while no decode seat waits for it
        # (Scheduler.update_kv_transfers): the client gets it with the first token D computes.
        self.held_tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # of each output token, when params.logprobs asks
        self.prompt_logprobs: list[TokenLogprob | None] = []  # of each prompt token (the first: None), when asked

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

    def append_tokens(self, token_ids: list[int], times: list[float]) -> None:
        """Several sampled tokens at once (a steady decode run, Scheduler.advance_decode_steps): as
        append_token for each, where only the last can end the request (the caller checked: no stop
        string or grammar, no stop token before the last, no length limit before it)."""
        if len(token_ids) > 1:
            first = token_ids[:-1]
            self.token_ids.extend(first)
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = times[0]
            self.metrics.token_times.extend(times[:-1])
            self.detokenizer.extend(first)
        self.append_token(token_ids[-1], times[-1])

    def output(self, new_token_ids: list[int]) -> RequestOutput:
        """What the client sees of this request now."""
        finished = self.status.finished
        return RequestOutput(
            request_id=self.client_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=self.detokenizer.text,
            new_token_ids=new_token_ids,
            text_delta=self.detokenizer.take_delta(self.stop_holdback, finished),
            finished=finished,
            finish_reason=self.status.finish_reason,
            metrics=self.metrics,
            kv_transfer_params=self.kv_transfer_params_out,
            error=self.error,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs if self.params.prompt_logprobs is not None else None,
            index=self.index,
        )
