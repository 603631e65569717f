"""A simulated node: the engine's own Scheduler, BlockManager and KV connector (scheduler side)
on the simulation's clock, with the model runner replaced by the profile's step costs. A request's
work on a node is a Job; a run of steady decode steps is one event (DecodeRun:
Scheduler.steady_decode_steps / advance_decode_steps)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

from pdserve.config import KVTransferConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.detokenizer import NoText
from pdserve.engine.messages import DecodeSteps, RequestMetrics, RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, is_decode
from pdserve.kv.connector import ConnectorMetadata, FinishedTransfers, KVConnectorScheduler
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferResult
from pdserve.kv.params import KVTransferParams
from pdserve.plan.corun import RELAY_STREAMS
from pdserve.plan.sim.events import Costs, Simulation
from pdserve.plan.sim.setup import Batching
from pdserve.plan.sim.tracker import Tracker
from pdserve.sampling_params import SamplingParams

NEVER = 1 << 62  # a simulated request's max_model_len: the pool (checked on submit) is the limit


@dataclass
class Job:
    """A request's work on one node: `prompt_tokens`, then `output_tokens` tokens, the first
    sampled by the step that computes the last prompt token. `kv_params`: the kv_transfer_params
    the proxy tags it with (P: keep or push the KV; D: it comes from P; the node's connector
    reserves blocks for it, and `on_reserved` tells the proxy). `hashes`: with prefix caching, its
    full blocks' hashes (prompt, then output tokens), which stand for its tokens (the simulator
    draws none)."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    tokens: Tracker | None  # where the tokens go (None: a prefill node's token, which the client never sees)
    on_done: Callable[[float], None]
    hashes: list[int] | None = None
    kv_params: KVTransferParams | None = None
    # D: blocks are reserved for this many tokens from P (push: and D's announcement for the proxy).
    on_reserved: Callable[[int, KVTransferParams | None], None] | None = None
    answer_params: KVTransferParams | None = None  # P, pull: where its KV is held (the proxy forwards it to D)
    metrics: RequestMetrics | None = None  # the engine's, once done: the node's queue, TTFT and KV wait


@functools.lru_cache(maxsize=None)
def _params(max_tokens: int) -> SamplingParams:
    """A simulated request's sampling parameters (shared: a Request only reads them)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def connector_for(role: str, name: str, block_size: int) -> KVConnectorScheduler | None:
    """The engine's KV connector, scheduler side, for a node of `role` (None when colocated): P
    holds a pulled prompt's blocks, D reserves blocks for remote KV. Holds never time out here:
    the proxy releases each when its modelled transfer ends."""
    if role == "both":
        return None
    return KVConnectorScheduler(KVTransferConfig(role=role), block_size, HeldBlocks(math.inf), name)


@dataclass
class DecodeRun:
    """`steps` decode steps of the steady batch `out`, taken as one event: step j (from 0) lasts
    first_step + growth * j, since each step adds a token to every sequence of the batch."""

    start: float
    first_step: float
    growth: float
    steps: int
    out: SchedulerOutput
    kv_tokens: int  # the batch's KV tokens in its first step (each step adds one per sequence)
    lead: float = 0.0  # its node idled before it: its first step pays that much more (start is after it)

    def elapsed(self, steps: int) -> float:
        return steps * self.first_step + self.growth * steps * (steps - 1) / 2

    def steps_done_by(self, time: float) -> int:
        """Steps finished between start and `time`."""
        t, a, g = time - self.start, self.first_step, self.growth
        if t <= 0:  # (a run may start late: its node's first step after idling pays Costs.after_idle)
            return 0
        if a <= 0 and g <= 0:
            return self.steps
        k = int(t / a) if g <= 0 else int((-(a - g / 2) + math.sqrt((a - g / 2) ** 2 + 2 * g * t)) / g)
        k = max(0, min(k, self.steps))
        while k > 0 and self.elapsed(k) > t:  # floating point at the edges
            k -= 1
        while k < self.steps and self.elapsed(k + 1) <= t:
            k += 1
        return k


@dataclass
class SimNode:
    """One node: the engine's Scheduler (running requests first, in the order they were admitted,
    then waiting ones within the token budget; KV blocks by its BlockManager as tokens are
    computed; when a running request cannot get a block, the newest running one is preempted and
    recomputed later) and its step loop, in costs."""

    sim: Simulation
    name: str
    batching: Batching
    prefix_caching: bool = False
    role: str = "both"  # both (colocated) | prefill | decode
    costs: Costs | None = None  # its step costs (None: the simulation's, the profile's threads)
    busy: bool = False
    active: bool = False  # computing step after step (busy between steps too): others on its host slow down
    streams: int = 0  # running requests past their first token, as last told to the host (its relay slows others)
    idle_since: float = -math.inf  # when it last ran out of work: its next step pays Costs.after_idle
    run: DecodeRun | None = None
    run_token: int = 0  # invalidates a decode run's scheduled end once the run is cut short
    preemptions: int = 0
    decode: DecodeSteps = DecodeSteps()  # its decode-only steps, counted as the engine counts them
    cached: CachedHashes | None = field(init=False)  # the hashes its prefix cache holds (the proxy's index reads it)
    blocks: BlockManager = field(init=False)
    connector: KVConnectorScheduler | None = field(init=False)
    scheduler: Scheduler = field(init=False)
    jobs: dict[str, Job] = field(init=False, default_factory=dict)
    arrived: list[Job] = field(init=False, default_factory=list)  # KV arrived during the step in progress

    def __post_init__(self) -> None:
        limits = self.batching
        self.costs = self.costs or self.sim.costs
        self.cached = CachedHashes() if self.prefix_caching else None
        self.blocks = BlockManager(limits.num_blocks, limits.block_size, self.prefix_caching, events=self.cached)
        self.connector = connector_for(self.role, self.name, limits.block_size)
        self.scheduler = Scheduler(self.blocks, limits.max_seqs, limits.budget, limits.chunked,
                                   connector=self.connector, clock=lambda: self.sim.now, prefill_cap=limits.prefill_cap)
        self.sim.nodes.append(self)

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def _request(self, job: Job) -> Request:
        """The engine's Request for a job: placeholder token ids, its hashes standing for them."""
        req = Request(str(job.request_id), [0] * job.prompt_tokens, _params(job.output_tokens), NoText(), (), NEVER,
                      None, job.kv_params, arrival_time=self.sim.now)
        if job.hashes is not None and self.cached is not None:
            # Blocks of output nobody asks for again hold tokens the simulator never draws: a
            # stand-in hash each, matching nothing (the engine would file real ones).
            full = (job.prompt_tokens + job.output_tokens) // self.batching.block_size
            req.block_hashes = job.hashes + [("unseen", job.request_id, i) for i in range(len(job.hashes), full)]
        return req

    def submit(self, job: Job) -> None:
        if self.batching.blocks_for(job.prompt_tokens + job.output_tokens) > self.batching.num_blocks:
            return  # larger than the whole pool: the engine refuses it (max_model_len <= the pool)
        req = self._request(job)
        self.jobs[req.request_id] = job
        self.scheduler.add(req)
        self._news()

    def kv_arrived(self, job: Job) -> None:
        """D: the KV the connector reserved blocks for has arrived (pulled, or its last layer pushed,
        with P's first token: a placeholder id, as every simulated token). The engine's loop reads
        finished transfers between steps, so a KV that arrives during a step waits for its end (the
        first token with it); an idle node takes it at once."""
        if self.busy:
            self.arrived.append(job)
            if self.run is not None:
                self._cut_run()
            return
        self._receive(job)
        self._maybe_step()

    def _receive(self, job: Job) -> None:
        push = job.kv_params.is_push
        result = TransferResult(str(job.request_id), None, "push" if push else "pull",
                                first_token_id=0 if push else None)
        outputs = self.scheduler.update_kv_transfers(FinishedTransfers(received=[result]))
        self._tokens(outputs, self.sim.now)  # D starts from P's first token, which the client gets now
        self._done(outputs, self.sim.now)
        self._count_streams()

    def release(self, job: Job) -> None:
        """P: D has pulled a held prompt's KV, so its blocks are freed (as the connector's worker
        reports a finished send)."""
        self.connector.held.release(str(job.request_id))
        self.scheduler.update_kv_transfers(FinishedTransfers(sent=self.connector.held.pop_releasable()))
        self._news()

    def _news(self) -> None:
        """Work arrived: the scheduler sees it at the next step boundary, as the engine's loop would."""
        if self.run is not None:
            self._cut_run()
        self._maybe_step()

    def _cut_run(self) -> None:
        """New work arrived during a decode run: end the run with the step now in progress, so the
        scheduler sees the new job at the next step boundary, as the engine's loop would."""
        run = self.run
        steps = min(run.steps_done_by(self.sim.now) + 1, run.steps)
        if steps < run.steps:
            run.steps = steps
            self.run_token += 1
            token = self.run_token
            self.sim.at(run.start + run.elapsed(steps), lambda: self._finish_run(token))

    def _maybe_step(self) -> None:
        if self.busy or not self.scheduler.has_runnable():
            return
        out = self.scheduler.schedule()
        self.preemptions += len(out.preempted)
        while not out.scheduled and out.preempted:  # the engine's next loop turn admits what was freed
            out = self.scheduler.schedule()
            self.preemptions += len(out.preempted)
        if self.connector is not None:
            self._reserved(self.connector.build_connector_meta())
        if not out.scheduled:
            return  # the head of the queue waits for KV to be freed
        costs = self.costs
        self.busy = True
        decodes = [s for s in out.scheduled if is_decode(s)]
        cold = 0.0
        if not self.active:
            cold = costs.after_idle(self.sim.now - self.idle_since, len(decodes) < len(out.scheduled))
            self.active = True
            self._tell_host()
        slow_prefill, slow_decode = self._corun()
        kv_tokens = sum(s.request.num_tokens for s in decodes)  # the token fed this step included
        steps = self.scheduler.steady_decode_steps(out, NEVER)
        if steps == 1:
            seconds = slow_prefill * sum(costs.chunk(s.num_new_tokens, s.request.num_computed_tokens)
                                         for s in out.scheduled if not is_decode(s))
            seconds += slow_decode * costs.step(len(decodes), kv_tokens) if decodes else costs.step_serving
            seconds += cold
            if decodes and len(decodes) == len(out.scheduled):
                self._count_decode(1, max(seconds, 0.0), len(decodes), kv_tokens)
            self.sim.at(self.sim.now + max(seconds, 0.0), lambda: self._finish_step(out))
            return
        # Every running request decodes and no waiting one can be admitted meanwhile: the batch stays
        # the same until one finishes, blocks run out, or new work arrives (submit cuts the run
        # short). Its steps are one event.
        first = max(slow_decode * costs.step(len(decodes), kv_tokens), 0.0)
        growth = max(slow_decode * costs.step(len(decodes), kv_tokens + len(decodes)), 0.0) - first
        self.run = DecodeRun(self.sim.now + cold, first, growth, steps, out, kv_tokens, cold)
        self.run_token += 1
        token = self.run_token
        self.sim.at(self.run.start + self.run.elapsed(steps), lambda: self._finish_run(token))

    def _count_decode(self, steps: int, seconds: float, seqs: int, kv_tokens: int) -> None:
        d = self.decode
        self.decode = DecodeSteps(d.steps + steps, d.seconds + seconds, d.seqs + seqs, d.kv_tokens + kv_tokens)

    def _reserved(self, meta: ConnectorMetadata) -> None:
        """D: the connector reserved blocks this step for pulls (meta.loads) and pushes (meta.expects);
        their jobs tell the proxy, which models the transfer and calls kv_arrived."""
        for spec in meta.loads:
            self._report_reserved(spec.request_id, None)
        for spec in meta.expects:
            self._report_reserved(spec.request_id, spec.announcement({}))

    def _report_reserved(self, request_id: str, announcement: KVTransferParams | None) -> None:
        job = self.jobs[request_id]
        job.on_reserved(self.scheduler.loading[request_id].kv_external_tokens, announcement)

    def _finish_step(self, out: SchedulerOutput) -> None:
        now = self.sim.now
        outputs = self.scheduler.update_from_output(out, {s.request.request_id: 0 for s in out.scheduled if s.samples})
        self._tokens(outputs, now)
        self._retire(outputs, now)

    def _tokens(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            job = self.jobs[output.request_id]
            if job.tokens is not None:
                for _ in output.new_token_ids:  # two at once: P's first token, held for a seat, and D's
                    job.tokens.token(now)

    def _finish_run(self, token: int) -> None:
        if token != self.run_token:
            return  # this run was cut short; its new end is scheduled
        run, self.run = self.run, None
        seqs, steps = len(run.out.scheduled), run.steps
        kv_tokens = steps * run.kv_tokens + seqs * steps * (steps - 1) // 2
        self._count_decode(steps, run.lead + run.elapsed(steps), seqs * steps, kv_tokens)  # (its idle lead too)
        start, a, g = run.start, run.first_step, run.growth
        half = g / 2
        times = [start + j * (a + half * (j - 1)) for j in range(1, run.steps + 1)]  # DecodeRun.elapsed(j)
        zeros = [0] * run.steps  # every request's tokens (read, not kept)
        outputs = self.scheduler.advance_decode_steps(run.out, {s.request.request_id: zeros for s in run.out.scheduled},
                                                      times)
        for output in outputs:
            job = self.jobs[output.request_id]
            if job.tokens is not None:
                job.tokens.steps(self.sim.now, run.first_step, run.growth, run.steps, run.lead)
        self._retire(outputs, self.sim.now)

    def _retire(self, outputs: list[RequestOutput], now: float) -> None:
        self._done(outputs, now)
        self.busy = False
        arrived, self.arrived = self.arrived, []
        for job in arrived:  # KV that arrived during the step: read between steps, as the engine's loop does
            self._receive(job)
        self._maybe_step()
        if not self.busy and self.active:  # out of work: the host's other nodes speed up
            self.active = False
            self.idle_since = now
            self._tell_host()
        self._count_streams()

    def _done(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            if output.finished:
                job = self.jobs.pop(output.request_id)
                job.answer_params, job.metrics = output.kv_transfer_params, output.metrics
                job.on_done(now)

    def _corun(self) -> tuple[float, float]:
        """(prefill, decode) slow-down of a step starting now on one host (Simulation(one_host=True)).
        The relay factors grow with the streams other nodes have under way (running requests past
        their first token), up to the RELAY_STREAMS the profile measured them at: the proxy is woken
        at each of their tokens. This node's own streams do not count: they wait for its step. While
        another node computes, the co-run factors too, and decode's relay factor (no idle core is left
        for the relay)."""
        corun = self.sim.corun
        if corun is None:
            return 1.0, 1.0
        share = min(sum(n.streams for n in self.sim.nodes if n is not self) / RELAY_STREAMS, 1.0)
        relay = 1 + (self.sim.relay - 1) * share
        if not any(n.active for n in self.sim.nodes if n is not self):
            return relay, 1.0
        return corun[0] * relay, corun[1] * (1 + (self.sim.relay_decode - 1) * share)

    def _count_streams(self) -> None:
        """On one host: a stream started or ended here, so the other nodes' relay factors change
        (their decode runs end with the step in progress)."""
        if self.sim.corun is not None:
            streams = sum(1 for r in self.scheduler.running if r.num_output_tokens)
            if streams != self.streams:
                self.streams = streams
                self._tell_host()

    def _tell_host(self) -> None:
        """This node started or stopped computing or streaming: the host's other nodes end their decode runs
        with the step in progress, and cost the next ones at their new speed."""
        if self.sim.corun is not None:
            for node in self.sim.nodes:
                if node is not self and node.run is not None:
                    node._cut_run()


class CachedHashes(set):
    """The hashes a node's prefix cache holds, kept by BlockManager's events (filed, dropped): the
    simulated proxy's prefix index reads it live."""

    def stored(self, block_hash: int) -> None:
        self.add(block_hash)

    def removed(self, block_hash: int) -> None:
        self.discard(block_hash)
