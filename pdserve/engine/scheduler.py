"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute.

Every request is a number of tokens still to compute (prompt, or one new token while decoding).
Each step the running requests are served first, oldest first, then waiting ones are admitted
while the budget, `max_num_seqs` and free blocks allow. When blocks run out the newest running
request is preempted: its blocks are freed and it is recomputed later from its tokens so far.
With `prefill_cap`, a step that decodes computes at most that many prompt tokens: a long prompt
then lengthens each gap between the decoding streams' tokens by one such chunk, not by its whole
prefill (an inter-token SLO); with no stream decoding, prompts take the whole budget.

A request for n sequences is n requests. The first computes the prompt (or loads its KV from a
prefill node); the others wait until it has, then share its prompt's full blocks (reference
counted, `_fork`) and each computes only the rest of the prompt, at least the last token, whose
logits it samples its own first token from.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.messages import RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv.params import first_token_from_prefill, moves_whole_prompt, wants_remote_prefill

if TYPE_CHECKING:
    from pdserve.kv.connector import FinishedTransfers, KVConnectorScheduler
    from pdserve.kv.stats import KVStats


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step completes the request's known tokens, so a next token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        connector: KVConnectorScheduler | None = None,
        kv_stats: KVStats | None = None,
        load_failure_policy: str = "recompute",
        clock: Callable[[], float] = time.perf_counter,
        prefill_cap: int | None = None,
    ) -> None:
        # The time its requests' metrics are stamped with: the wall clock in the engine, a virtual
        # one where a simulator drives this scheduler with modelled step costs (issue 36).
        self.clock = clock
        self.block_manager = block_manager
        self.connector = connector
        self.kv_stats = kv_stats
        self.load_failure_policy = load_failure_policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        if prefill_cap is not None and (prefill_cap < 0 or not enable_chunked_prefill):
            raise ValueError(f"a prefill cap while decoding needs chunked prefill and >= 0 tokens, got {prefill_cap}")
        self.prefill_cap = prefill_cap
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}  # D: WAITING_FOR_REMOTE_KV, blocks reserved
        self.held: dict[str, Request] = {}  # P: finished, blocks kept until a D pulls them
        self.forks: dict[str, list[Request]] = {}  # n > 1: the sequences waiting for their first's prompt blocks
        self.families: dict[str, list[Request]] = {}  # n > 1: the client's request id -> its n sequences

    def add(self, req: Request, siblings: Sequence[Request] = ()) -> None:
        """Queue a request; its siblings (the other n - 1 sequences) wait for it to compute the prompt."""
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if self.connector is not None:
            self.connector.request_added(req)
        if siblings:
            for sibling in siblings:
                self.requests[sibling.request_id] = sibling
            self.forks[req.request_id] = list(siblings)
            self.families[req.client_id] = [req, *siblings]

    def has_unfinished(self) -> bool:
        """Requests still owed an answer, or blocks still owed to a transfer."""
        return bool(self.requests or self.held or self.loading or (self.connector and self.connector.has_pending()))

    def has_runnable(self) -> bool:
        """Work the model can do this step (as opposed to waiting on transfers)."""
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Streams decode here: prompt tokens (and recomputed ones) take at most the cap this step.
        capped = self.prefill_cap is not None and any(r.num_computed_tokens >= r.num_prompt_tokens
                                                      for r in self.running)
        prefill_budget = self.prefill_cap if capped else budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if capped and (n > 1 or req.num_computed_tokens < req.num_prompt_tokens):  # not a decode token
                n = min(n, prefill_budget)
                if n == 0:  # the cap is spent: it goes on next step
                    i += 1
                    continue
                prefill_budget -= n
            while not self.block_manager.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
        if not out.preempted:  # admitting new work while evicting old would just thrash
            self._admit_waiting(out, min(budget, prefill_budget))
        now = self.clock()
        chunks = [s for s in out.scheduled if not is_decode(s)]
        step_tokens = sum(s.num_new_tokens for s in chunks)
        for s in out.scheduled:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        for s in chunks:
            s.request.metrics.prefill_step_tokens += step_tokens
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            remote = self.connector is not None and wants_remote_prefill(req.kv_transfer_params)
            if budget <= 0 and not remote:  # a prompt whose KV is loaded computes nothing here: no budget needed
                break
            prefix = self.block_manager.match_prefix(req) if req.num_computed_tokens == 0 else []
            # Tokens computed once the prefix hit is taken (a fork's shared blocks too).
            cached = req.num_computed_tokens + (len(prefix[0]) if prefix else 0) * self.block_manager.block_size
            if remote:
                if not self._start_remote_load(req, prefix, self.connector.get_num_new_matched_tokens(req, cached)):
                    break
                continue
            remaining = req.num_tokens - cached
            if not self.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            if not self.block_manager.allocate(req, n, prefix):
                break
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_cached_tokens = cached
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def _start_remote_load(self, req: Request, prefix: list[list[int]], external: int) -> bool:
        """Reserve blocks for the remote tokens and park req until its KV has arrived."""
        if not self.block_manager.allocate(req, external, prefix, loaded=True):
            return False
        req.metrics.num_cached_tokens = (len(prefix[0]) if prefix else 0) * self.block_manager.block_size
        req.metrics.first_scheduled_time = self.clock()
        self.connector.update_state_after_alloc(req, external)
        req.kv_external_tokens = external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting.popleft()
        self.loading[req.request_id] = req
        return True

    def update_kv_transfers(self, finished: FinishedTransfers) -> list[RequestOutput]:
        """Apply finished sends (P: free held blocks) and receives (D: resume or fail requests)."""
        outputs = []
        for request_id, error in finished.push_failed:  # P: the decode node is gone or refused
            req = self.requests.get(request_id)
            if req is not None:
                req.error = f"pushing KV to the decode node failed: {error}"
                outputs.extend(self.abort(request_id))
        for request_id, expired in finished.sent:
            req = self.held.pop(request_id, None)
            if req is not None:
                self.block_manager.free(req)
            if expired and self.kv_stats is not None:
                self.kv_stats.add_hold_expired()
        now = self.clock()
        for result in finished.received:
            req = self.loading.pop(result.request_id, None)
            if req is None:
                continue
            req.metrics.kv_load_seconds = now - req.metrics.first_scheduled_time
            req.metrics.kv_bytes, req.metrics.kv_transport = result.nbytes, result.transport
            params = req.kv_transfer_params
            first_token = first_token_from_prefill(params, result.first_token_id)
            req.kv_transfer_params = None  # loaded (or given up): never load twice
            if req.status.finished:  # aborted while its blocks were being written: free them now
                self.block_manager.free(req)
                continue
            if result.error is None:
                if first_token is None and moves_whole_prompt(params):
                    req.kv_external_tokens -= 1  # P sent no first token: compute the last prompt token here
                req.num_computed_tokens += req.kv_external_tokens
                req.metrics.num_remote_tokens = req.kv_external_tokens
                req.metrics.kv_blocks = -(-req.kv_external_tokens // self.block_manager.block_size)
                self.block_manager.cache_full_blocks(req)  # loaded blocks are computed ones: reusable now
                if self.kv_stats is not None:
                    self.kv_stats.add_remote_tokens(req.kv_external_tokens)
                if first_token is not None:  # the whole prompt came from P: decode from P's first token
                    req.append_token(first_token, now)
                    if req.status.finished:
                        self._finish(req)
                        outputs.append(req.output([first_token]))
                        continue
                    req.held_tokens = [first_token]  # streamed below, or with D's first token
            elif self.load_failure_policy == "fail":
                req.error = f"KV transfer from the prefill node failed: {result.error}"
                outputs.extend(self.abort(req.client_id))
                continue
            # Loaded, or recompute: continue from what is valid (the recompute prefills locally),
            # next in line after the requests that arrived before it.
            req.kv_external_tokens = 0
            req.status = RequestStatus.WAITING
            place = self._behind_block_holders()
            self.waiting.insert(place, req)
            # P's first token streams now only if the next step seats the request: past
            # max_num_seqs it would wait for a seat after its first token, a gap an ITL SLO counts
            # (a stream-capped D). Held, it streams with the first token D computes: the wait
            # counts in TTFT, as when D's own queue holds a request.
            if req.held_tokens and len(self.running) + place < self.max_num_seqs:
                outputs.append(req.output(req.held_tokens))
                req.held_tokens = []
        return outputs

    def _behind_block_holders(self) -> int:
        """Where in the waiting queue a request goes that must run before new ones but after those
        that hold their blocks already (KV loaded from P, a fork's shared prompt)."""
        i = 0
        while i < len(self.waiting) and any(self.waiting[i].block_tables):  # ([[]]: a failed allocation's)
            i += 1
        return i

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        # Next in line, but behind the waiting requests that hold their blocks already: ahead of
        # them it would take back the blocks it just gave up and the step's budget, run out of
        # blocks again and never let them run (livelock).
        self.waiting.insert(self._behind_block_holders(), req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        """Advance the scheduled requests by what the model computed; finish the ones that stop."""
        now = self.clock()
        outputs = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if req.request_id in self.forks and req.num_computed_tokens >= req.num_prompt_tokens:
                self._fork(req)
            token = sampled.get(req.request_id)
            if token is None:
                if req.params.max_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
                    req.status = RequestStatus.FINISHED_LENGTH  # echo's scoring call: the prompt was all it asked
                    self._finish(req)
                    outputs.append(req.output([]))
                continue  # a prefill chunk that does not reach the end of the prompt yet
            req.append_token(token, now)
            if req.status.finished:
                self._finish(req)
            if req.held_tokens:  # P's first token, held for a seat: the client's first token is now
                req.metrics.first_token_time = req.metrics.token_times[-2] = now
                outputs.append(req.output(req.held_tokens + [token]))
                req.held_tokens = []
                continue
            outputs.append(req.output([token]))
        return outputs

    # -- steady decode runs: k steps of one batch taken at once (a simulator's fast path, issue 36) --

    def steady_decode_steps(self, out: SchedulerOutput, most: int) -> int:
        """How many steps in a row, `out` (just scheduled) the first, `schedule` would give this same
        batch, each request decoding one more token: every running request decodes, none was
        preempted, and no waiting request can be admitted meanwhile. At most `most`; at most until a
        request reaches max_tokens or max_model_len; at most what the free blocks cover. 1 when the
        batch may change after this step. Stop tokens and strings are not known ahead: the tokens
        given to `advance_decode_steps` decide those."""
        running = self.running
        if most <= 1 or out.preempted or len(out.scheduled) != len(running) or not all(
                is_decode(s) for s in out.scheduled) or any(r.held_tokens for r in running):
            return 1
        if any(self.block_manager.group_windows):
            return 1  # sliding groups give blocks back as their windows move: a waiting head may fit then
        # A waiting head that was not admitted stays out: the budget and the seats stay, free blocks
        # only shrink. A block a run fills may make it a longer prefix-cache hit, one block fewer to
        # take, but the request that filled it takes its next block in the same schedule(), before
        # the waiting are tried (tests/test_steady_decode.py has next turns waiting on their history).
        steps = min([most] + [min(r.params.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens)
                              for r in running])
        manager = self.block_manager

        def blocks_for(k: int) -> int:  # new blocks for k steps (the first step's are held)
            return sum(max(0, manager.blocks_needed(r.num_computed_tokens + k) - len(table))
                       for r in running for table in r.block_tables)

        return most_steps(max(steps, 1), lambda k: blocks_for(k) <= manager.num_free_blocks)

    def advance_decode_steps(self, out: SchedulerOutput, tokens: dict[str, Sequence[int]],
                             times: Sequence[float]) -> list[RequestOutput]:
        """len(times) steps of the steady batch `out` at once: request r samples tokens[r][j] at
        times[j] in step j. At most the steps steady_decode_steps gave when `out` was scheduled
        (work that arrived since waits for the next schedule(), as it would at a step boundary).
        What scheduling each step and update_from_output give, but the block ids handed out
        (tests/test_steady_decode.py). Refused: steps past a request's end, and a token that could
        stop a request before the last step (a stop token, a stop string, a grammar)."""
        k = len(times)
        if k < 1 or len(out.scheduled) != len(self.running) or not all(is_decode(s) for s in out.scheduled):
            raise ValueError("not a steady decode batch")
        for s in out.scheduled:
            req = s.request
            if k > min(req.params.max_tokens - req.num_output_tokens, req.max_model_len - req.num_tokens):
                raise ValueError(f"request {req.request_id} ends before step {k}")
            if req.params.stop or req.grammar is not None or not req.stop_token_ids.isdisjoint(
                    tokens[req.request_id][: k - 1]):
                raise ValueError(f"request {req.request_id} may stop before step {k}: take single steps")
        manager, size = self.block_manager, self.block_manager.block_size
        reqs = [s.request for s in out.scheduled]
        starts = [req.num_computed_tokens for req in reqs]
        for req in reqs:  # the tokens first: filing a block hashes the tokens it holds
            req.append_tokens(list(tokens[req.request_id][:k]), list(times))
        # Blocks are taken and filed in the order step-by-step scheduling takes them (two requests
        # may fill blocks of the same hash: which one's is cached decides what a later eviction
        # drops): step j takes the blocks its tokens start (schedule), then files the blocks its
        # tokens fill (update_from_output), request by request. Only those steps are visited.
        events = []
        caching = manager.enable_prefix_caching  # (without a prefix cache, filing a block does nothing)
        for i, start in enumerate(starts):
            events += [(j, 0, i) for j in range(-start % size, k, size) if j]  # position start + j opens a block
            if caching:
                events += [(j, 1, i) for j in range(-(start + 1) % size, k, size)]  # position start + j fills one
        for j, filing, i in sorted(events):
            req = reqs[i]
            req.num_computed_tokens = starts[i] + j + filing
            if filing:
                manager.cache_full_blocks(req)
            elif not manager.allocate(req, 1):
                raise RuntimeError(f"no block for step {j} of {req.request_id}: steady_decode_steps said they fit")
        outputs = []
        for req, start in zip(reqs, starts):
            req.num_computed_tokens = start + k
            if req.status.finished:
                self._finish(req)
            outputs.append(req.output(list(tokens[req.request_id][:k])))
        return outputs

    def _fork(self, first: Request) -> None:
        """`first` has computed its prompt: its siblings take the prompt's full blocks (all but the
        block holding the last prompt token, which each computes itself) and queue at the front."""
        bs = self.block_manager.block_size
        prefix = self.block_manager.fork_prefix(first, (first.num_prompt_tokens - 1) // bs)
        shared = len(prefix[0]) if prefix else 0
        for sibling in reversed(self.forks.pop(first.request_id)):
            self.block_manager.allocate(sibling, 0, prefix)  # takes references, no new blocks
            sibling.block_hashes = first.block_hashes[:shared]
            if sibling.params.prompt_logprobs is not None:  # those of the shared tokens are computed already
                sibling.prompt_logprobs = first.prompt_logprobs[: shared * bs + 1]
            self.waiting.appendleft(sibling)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort a request: the client's id aborts all n of its sequences (an engine id, that one)."""
        family = self.families.get(request_id)
        if family is None:
            family = [self.requests[request_id]] if request_id in self.requests else []
        live = [req for req in family if not req.status.finished]
        for req in live:
            if not req.status.finished:  # aborting the first may have ended siblings still waiting for it
                self._abort(req)
        return [req.output([]) for req in live]

    def _abort(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        if req.request_id in self.loading:
            # A loader is writing into its blocks: they are freed when the load reports back.
            del self.requests[req.request_id]
            self.connector.request_aborted(req)
            self._end_family(req)
        else:
            self._finish(req)

    def _end_family(self, req: Request) -> None:
        """req has finished: siblings still waiting for its prompt end with it (it never computed
        the prompt); the family is forgotten once all its sequences have finished."""
        for sibling in self.forks.pop(req.request_id, ()):
            sibling.status, sibling.error = RequestStatus.FINISHED_ABORTED, req.error
            self._finish(sibling)
        family = self.families.get(req.client_id)
        if family is not None and all(r.status.finished for r in family):
            del self.families[req.client_id]

    def _finish(self, req: Request) -> None:
        self._end_family(req)
        if req in self.running:
            self.running.remove(req)
        keep_blocks = False
        if self.connector is not None:
            keep_blocks, req.kv_transfer_params_out = self.connector.request_finished(req)
        if keep_blocks:
            self.held[req.request_id] = req
        else:
            self.block_manager.free(req)
        del self.requests[req.request_id]


def is_decode(s: ScheduledRequest) -> bool:
    """One new token after an output token. A lone prompt token (the last one, computed by a decode
    node whose KV came from P) is a prefill chunk: it takes the path a colocated node's prefill takes."""
    return s.num_new_tokens == 1 and s.request.num_computed_tokens >= s.request.num_prompt_tokens


def most_steps(steps: int, fits: Callable[[int], bool]) -> int:
    """The most of `steps` steps (>= 1) for which `fits`, a test that holds for 1 and, once false,
    stays false for more steps (blocks a run takes only grow with its length)."""
    if fits(steps):  # the common case: blocks to spare
        return steps
    lo, hi = 1, steps - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
