"""A discrete-event model of pdserve serving a workload, driven by a measured profile.

    pdserve simulate --profile profile.json --setup colocated:2|pull:1P1D|push:1P3D [bench's workload flags]

What it models, as pdserve does it:
- the proxy: colocated (each request to one `--role both` node), pull (P prefills and samples one
  token, D pulls the KV, recomputes the last prompt token and decodes), push (D reserves its blocks
  first, P pushes each layer as it is computed, so only the last layer's transfer follows the
  prefill); nodes picked by round robin or least loaded (outstanding requests);
- each node's scheduler, one step at a time, as pdserve's Scheduler runs it (a test checks the two
  token for token): running requests first, in the order they were admitted, then waiting ones
  within the token budget (chunked prefill) and max_num_seqs; KV blocks taken as tokens are
  computed; when a running request cannot get a block the newest one is preempted and later
  prefilled again with its output so far; a P node holds a prompt's blocks until its KV has left
  (pulled by D, or its last layer pushed); steps that only decode a batch that does not change
  are one event (a decode run, ended early where blocks would run out), so the cost of simulating
  grows with requests, not with tokens;
- the step's time: the profile's decode-step fit for the decodes plus its prefill-chunk fit for
  each chunk, plus what the server adds per step; each HTTP hop to a node (one colocated, P's and
  D's in pull, P's in push, where D had the request during the prefill) adds the profile's
  per-request serving cost, and streaming delays every token the client sees by its stream cost;
  transfers: the profile's fit for the transport.

Not modelled: the prefix cache (every prompt is computed in full), and D's blocks while a pull is
in flight (the transfer is charged before D queues the request).

It returns the fields `pdserve bench --out` writes (pdserve/workload.py: summarize), so a
simulated and a measured run compare key by key.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdserve.plan.profile import Profile
from pdserve.workload import BenchRequest, RequestResult, arrival_gaps, summarize

MODES = ("colocated", "pull", "push")
POLICIES = ("round_robin", "least_loaded")


@dataclass(frozen=True)
class Setup:
    mode: str
    prefill: int  # P nodes (0 when colocated)
    decode: int  # D nodes, or colocated nodes

    @classmethod
    def parse(cls, text: str) -> Setup:
        """`colocated:N`, `pull:xPyD` or `push:xPyD`; ValueError names what is wrong."""
        mode, _, shape = text.partition(":")
        if mode == "colocated" and shape.isdigit() and int(shape) > 0:
            return cls(mode, 0, int(shape))
        match = re.fullmatch(r"(\d+)P(\d+)D", shape)
        if mode in ("pull", "push") and match and int(match[1]) > 0 and int(match[2]) > 0:
            return cls(mode, int(match[1]), int(match[2]))
        raise ValueError(f"--setup {text!r}: expected colocated:N, pull:xPyD or push:xPyD (e.g. pull:1P3D)")


@dataclass
class Job:
    """A request's work on one node, counted as the engine's Request counts it: `prompt_tokens`, of
    which `context` arrive computed (KV from P), then `output_tokens` tokens, the first sampled by
    the step that computes the last prompt token. A preempted job computes all it has again."""

    request_id: int
    prompt_tokens: int
    context: int
    output_tokens: int
    tokens: Tracker | None  # where the tokens go (None: a prefill node's token, which the client never sees)
    on_done: Callable[[float], None]
    hold: bool = False  # P: keep the KV blocks after the last token until the proxy releases them
    computed: int = 0
    generated: int = 0
    blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(frozen=True)
class Costs:
    """The profile's prefill-chunk and decode-step fits as plain numbers: the simulator's hot path
    (Profile.prefill_chunk_time and decode_step_time, without the feature dicts)."""

    chunk_fixed: float
    chunk_token: float
    chunk_pair: float  # per attention pair: tokens * (context_before + tokens / 2)
    step_fixed: float
    step_seq: float
    step_kv: float
    step_serving: float  # what the server adds to every step (profile.serving)
    request_hop: float  # what one HTTP hop adds before a node starts a request
    stream_delay: float  # how much later than the engine the client sees a streamed token

    @classmethod
    def of(cls, profile: Profile) -> Costs:
        p = dict(zip(profile.prefill_chunk.features, profile.prefill_chunk.coefficients))
        d = dict(zip(profile.decode_step.features, profile.decode_step.coefficients))
        return cls(p["one"], p["tokens"], p["attention_pairs"], d["one"], d["seqs"], d["kv_tokens"],
                   profile.serving["step_s"], profile.serving["request_s"], profile.serving["stream_s"])

    def chunk(self, tokens: int, context_before: int) -> float:
        return self.chunk_fixed + tokens * (self.chunk_token + self.chunk_pair * (context_before + tokens / 2))

    def step(self, seqs: int, kv_tokens: int) -> float:
        """A decode step, with what serving adds to each step."""
        return self.step_fixed + self.step_serving + self.step_seq * seqs + self.step_kv * kv_tokens


class Simulation:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.costs = Costs.of(profile)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


@dataclass
class DecodeRun:
    """`steps` decode steps of a constant batch, taken as one event: step j (from 0) lasts
    first_step + growth * j, since each step adds a token to every sequence of the batch."""

    start: float
    first_step: float
    growth: float
    steps: int
    jobs: list[Job]

    def elapsed(self, steps: int) -> float:
        return steps * self.first_step + self.growth * steps * (steps - 1) / 2

    def steps_done_by(self, time: float) -> int:
        """Steps finished between start and `time`."""
        t, a, g = time - self.start, self.first_step, self.growth
        if a <= 0 and g <= 0:
            return self.steps
        k = int(t / a) if g <= 0 else int((-(a - g / 2) + math.sqrt((a - g / 2) ** 2 + 2 * g * t)) / g)
        k = max(0, min(k, self.steps))
        while k > 0 and self.elapsed(k) > t:  # floating point at the edges
            k -= 1
        while k < self.steps and self.elapsed(k + 1) <= t:
            k += 1
        return k


@dataclass(frozen=True)
class Batching:
    """A node's scheduler settings (`pdserve serve`'s --max-num-batched-tokens, --no-chunked-prefill,
    --max-num-seqs) and its KV pool."""

    budget: int
    chunked: bool
    max_seqs: int
    capacity: int  # KV pool, tokens
    block_size: int = 16

    @classmethod
    def of(cls, node: dict, budget: int | None = None, chunked: bool = True) -> Batching:
        """The profiled node's settings, with the token budget and chunking a setup asks for.
        Without chunked prefill the budget is at least max_model_len, as the engine makes it."""
        budget = budget or node["max_num_batched_tokens"]
        if budget < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {budget}")
        if not chunked:  # a profile without max_model_len: no prompt is too long for one step
            budget = max(budget, node.get("max_model_len", 1 << 30))
        return cls(budget, chunked, node["max_num_seqs"], node["kv_capacity_tokens"], node.get("block_size", 16))

    @property
    def num_blocks(self) -> int:
        return self.capacity // self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass
class SimNode:
    """One node's scheduler and clock: pdserve's Scheduler (running requests first, in the order
    they were admitted, then waiting ones within the token budget; KV blocks allocated as tokens are
    computed; when a running request cannot get a block, the newest running request is preempted
    and recomputed later) and its step loop, in costs."""

    sim: Simulation
    name: str
    batching: Batching
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    busy: bool = False
    outstanding: int = 0  # requests given to this node and not finished here (least_loaded reads it)
    run: DecodeRun | None = None
    run_token: int = 0  # invalidates a decode run's scheduled end once the run is cut short
    free_blocks: int = field(init=False)
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.free_blocks = self.batching.num_blocks

    def submit(self, job: Job) -> None:
        if self.batching.blocks_for(job.prompt_tokens + job.output_tokens) > self.batching.num_blocks:
            return  # larger than the whole pool: the engine refuses it (max_model_len <= the pool)
        self.waiting.append(job)
        self.outstanding += 1
        if self.run is not None:
            self._cut_run()
        self._maybe_step()

    def release(self, job: Job) -> None:
        """The proxy's word that a held job's KV has left (pulled by D, or pushed)."""
        self._free(job)
        self._maybe_step()

    def _allocate(self, job: Job, tokens: int) -> bool:
        """Blocks for `tokens` computed tokens of job (BlockManager.allocate)."""
        needed = self.batching.blocks_for(tokens) - job.blocks
        if needed > self.free_blocks:
            return False
        if needed > 0:
            job.blocks += needed
            self.free_blocks -= needed
        return True

    def _free(self, job: Job) -> None:
        self.free_blocks += job.blocks
        job.blocks = 0

    def _preempt(self, job: Job) -> None:
        """Scheduler._preempt: free its blocks; its prompt and output so far are prefilled again."""
        self._free(job)
        job.computed = job.context = 0
        self.waiting.appendleft(job)
        self.preemptions += 1

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

    def _schedule(self) -> tuple[list[Job], list[tuple[Job, int]], bool]:
        """One step (Scheduler.schedule): its decodes, its prefill chunks (job, new tokens), and
        whether it preempted."""
        limits = self.batching
        budget, size = limits.budget, limits.block_size
        decodes: list[Job] = []
        chunks: list[tuple[Job, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            job = self.running[i]
            remaining = job.prompt_tokens + job.generated - job.computed
            n = min(remaining, budget)
            # (the first test skips the call while the job's last block has room: the hot path)
            while job.computed + n > job.blocks * size and not self._allocate(job, job.computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is job:
                    break
            else:
                if remaining == 1 and job.generated:  # one token after an output token: model_runner.is_decode
                    decodes.append(job)
                else:
                    chunks.append((job, n))
                budget -= n
                i += 1
        if preempted:  # admitting new work while evicting old would just thrash
            return decodes, chunks, True
        while self.waiting and budget > 0 and len(self.running) < limits.max_seqs:
            job = self.waiting[0]
            remaining = job.num_tokens - job.context
            if not limits.chunked and remaining > budget:
                break  # the whole prompt in one step, or wait for the next
            n = min(remaining, budget)
            if not self._allocate(job, job.context + n):
                break  # the head of the queue waits for blocks
            self.waiting.popleft()
            job.computed = job.context
            self.running.append(job)
            chunks.append((job, n))
            budget -= n
        return decodes, chunks, False

    def _maybe_step(self) -> None:
        if self.busy or not (self.waiting or self.running):
            return
        decodes, chunks, preempted = self._schedule()
        while not (decodes or chunks) and preempted:  # the engine's next loop turn admits what was freed
            decodes, chunks, preempted = self._schedule()
        if not (decodes or chunks):
            return  # the head of the queue waits for KV to be freed
        costs = self.sim.costs
        self.busy = True
        kv_tokens = sum(job.prompt_tokens + job.generated for job in decodes)  # the token fed this step included
        if chunks or preempted or len(decodes) < len(self.running):  # one step; the next may differ
            seconds = sum(costs.chunk(n, job.computed) for job, n in chunks)
            seconds += costs.step(len(decodes), kv_tokens) if decodes else costs.step_serving
            self.sim.at(self.sim.now + max(seconds, 0.0), lambda: self._finish_step(decodes, chunks))
            return
        # Every running job decodes and the waiting head could not be admitted (nor can it be in
        # the steps that follow: they only take blocks), so the batch stays the same until one of
        # them finishes, blocks run out, or new work arrives (submit cuts the run short): its steps
        # are one event.
        first = max(costs.step(len(decodes), kv_tokens), 0.0)
        growth = max(costs.step(len(decodes), kv_tokens + len(decodes)), 0.0) - first
        steps = self._steps_blocks_allow(decodes, min(j.output_tokens - j.generated for j in decodes))
        self.run = DecodeRun(self.sim.now, first, growth, steps, decodes)
        self.run_token += 1
        token = self.run_token
        self.sim.at(self.sim.now + self.run.elapsed(steps), lambda: self._finish_run(token))

    def _steps_blocks_allow(self, decodes: list[Job], steps: int) -> int:
        """The most of `steps` decode steps (the first one's blocks already held) the free blocks cover."""
        size = self.batching.block_size

        def needed(s: int) -> int:
            return sum(max(-(-(j.computed + s) // size) - j.blocks, 0) for j in decodes)

        if needed(steps) <= self.free_blocks:  # the common case: blocks to spare
            return steps
        lo, hi = 1, steps - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if needed(mid) <= self.free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _finish_step(self, decodes: list[Job], chunks: list[tuple[Job, int]]) -> None:
        now = self.sim.now
        emitting = list(decodes)
        for job in decodes:
            job.computed += 1
            job.generated += 1
        for job, n in chunks:
            job.computed += n
            if job.computed == job.prompt_tokens + job.generated:  # the prompt is done: its next token
                job.generated += 1
                emitting.append(job)
        for job in emitting:
            if job.tokens is not None:
                job.tokens.token(now)
        self._retire(emitting, now)

    def _finish_run(self, token: int) -> None:
        if token != self.run_token:
            return  # this run was cut short; its new end is scheduled
        run, self.run = self.run, None
        size = self.batching.block_size
        for job in run.jobs:
            job.computed += run.steps
            job.generated += run.steps
            if job.computed > job.blocks * size:  # the blocks its steps took, counted at the end
                self._allocate(job, job.computed)
            if job.tokens is not None:
                job.tokens.steps(self.sim.now, run.first_step, run.growth, run.steps)
        self._retire(run.jobs, self.sim.now)

    def _retire(self, jobs: list[Job], now: float) -> None:
        for job in jobs:
            if job.generated == job.output_tokens:
                self.running.remove(job)
                self.outstanding -= 1
                if not job.hold:
                    self._free(job)
                job.on_done(now)
        self.busy = False
        self._maybe_step()


@dataclass
class Tracker:
    """One request's client-side timings, as `pdserve bench` records them. Inter-token gaps are
    kept as runs (first gap, growth per step, count) and listed only when a result asks for them."""

    request: BenchRequest
    arrival: float
    gaps: list[tuple[float, float, int]] | None = field(default_factory=list)  # None: not kept
    first: float | None = None
    last: float = 0.0
    count: int = 0

    def token(self, time: float) -> None:
        if self.first is None:
            self.first = time
        elif self.gaps is not None:
            self.gaps.append((time - self.last, 0.0, 1))
        self.last, self.count = time, self.count + 1

    def steps(self, end: float, first_step: float, growth: float, count: int) -> None:
        """`count` tokens from back-to-back decode steps ending at `end` (the first token came before)."""
        if self.gaps is not None:
            self.gaps.append((first_step, growth, count))
        self.last, self.count = end, self.count + count

    def result(self, itls: bool = True, delay: float = 0.0) -> RequestResult:
        """`delay`: what streaming adds between the node and the client, to every token."""
        if self.first is None:  # never admitted: its prompt and output do not fit a node's KV pool
            return RequestResult(ok=False, input_len=self.request.input_len, start=self.arrival,
                                 error="does not fit the KV pool of any node")
        gaps = [(a + g * j) * 1e3 for a, g, n in self.gaps for j in range(n)] if itls and self.gaps else []
        return RequestResult(ok=self.count == self.request.output_len, input_len=self.request.input_len,
                             output_len=self.count, ttft_ms=(self.first + delay - self.arrival) * 1e3,
                             e2el_ms=(self.last + delay - self.arrival) * 1e3, itls_ms=gaps, start=self.arrival)


class Proxy:
    def __init__(self, sim: Simulation, setup: Setup, policy: str, transport: str, batching: Batching) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
        node = sim.profile.meta["node"]
        if transport not in sim.profile.transfer:
            raise ValueError(f"--kv-transport {transport!r}: the profile measured {sorted(sim.profile.transfer)}")
        self.sim, self.setup, self.policy, self.transport = sim, setup, policy, transport
        self.kv_bytes_per_token, self.num_layers = node["kv_bytes_per_token"], node["num_layers"]
        fit = dict(zip(sim.profile.transfer[transport].features, sim.profile.transfer[transport].coefficients))
        self._transfer_latency, self._transfer_per_byte = fit["one"], fit["bytes"]  # the hot path's copy of the fit

        self.prefillers = [SimNode(sim, f"P{i}", batching) for i in range(setup.prefill)]
        self.decoders = [SimNode(sim, f"D{i}" if setup.mode != "colocated" else f"N{i}", batching)
                         for i in range(setup.decode)]
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def _pick(self, nodes: list[SimNode], kind: str) -> SimNode:
        if self.policy == "least_loaded":
            return min(nodes, key=lambda n: (n.outstanding, nodes.index(n)))
        return nodes[next(self._turns[kind]) % len(nodes)]

    def arrive(self, rid: int, req: BenchRequest, tracker: Tracker) -> None:
        """Route one request; each HTTP hop to a node costs the profile's serving request_s."""
        hop, now = self.sim.costs.request_hop, self.sim.now
        if self.setup.mode == "colocated":
            node = self._pick(self.decoders, "decode")
            self.sim.at(now + hop, lambda: node.submit(Job(rid, req.input_len, 0, req.output_len, tracker, lambda t: None)))
            return
        decoder_job = Job(rid, req.input_len, req.input_len - 1, req.output_len, tracker, lambda t: None)
        nbytes = req.input_len * self.kv_bytes_per_token

        def prefilled(t: float) -> None:
            """P holds the KV until it has left: pulled by D, or its last layer pushed."""
            if self.setup.mode == "pull":  # P answers the proxy, which then sends the request to D
                decoder = self._pick(self.decoders, "decode")
                pulled = t + self.profile_transfer(nbytes) + hop
                self.sim.at(pulled, lambda: (prefiller.release(prefill_job), decoder.submit(decoder_job)))
            else:  # push: D had the request first; only the last layer's bytes follow the prefill
                pushed = t + self.profile_transfer(nbytes / self.num_layers)
                self.sim.at(pushed, lambda: (prefiller.release(prefill_job), push_decoder.submit(decoder_job)))

        push_decoder = self._pick(self.decoders, "decode") if self.setup.mode == "push" else None
        prefiller = self._pick(self.prefillers, "prefill")
        prefill_job = Job(rid, req.input_len, 0, 1, None, prefilled, hold=True)
        self.sim.at(now + hop, lambda: prefiller.submit(prefill_job))

    def profile_transfer(self, nbytes: float) -> float:
        return max(self._transfer_latency + self._transfer_per_byte * int(nbytes), 0.0)


def simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
             seed: int, slos: dict[str, float], policy: str = "round_robin", transport: str = "shm",
             max_num_batched_tokens: int | None = None, chunked_prefill: bool = True, itls: bool = True) -> dict:
    """The summary `pdserve bench` would write for this workload on this setup (pdserve/workload.py).
    Every node runs the profiled node's settings, with the token budget and chunking given here;
    itls=False leaves the per-token gaps out (the planner reads TTFT and TPOT only)."""
    if any(req.conversation is not None for req in requests):
        raise ValueError("--dataset multiturn: the simulator does not model conversations yet (turns that wait "
                         "for the previous answer and reuse its cached prefix)")
    sim = Simulation(profile)
    batching = Batching.of(profile.meta["node"], max_num_batched_tokens, chunked_prefill)
    proxy = Proxy(sim, setup, policy, transport, batching)
    trackers: list[Tracker] = []
    t = 0.0
    for rid, (req, gap) in enumerate(zip(requests, arrival_gaps(len(requests), rate, burstiness, seed))):
        t += gap
        tracker = Tracker(req, t, [] if itls else None)
        trackers.append(tracker)
        sim.at(t, lambda rid=rid, req=req, tracker=tracker: proxy.arrive(rid, req, tracker))
    sim.run()
    results = [tr.result(itls, sim.costs.stream_delay) for tr in trackers]
    duration = max((tr.last for tr in trackers if tr.first is not None), default=0.0)
    summary = summarize(results, duration, slos)
    summary.update({"setup": f"{setup.mode}:{setup.prefill}P{setup.decode}D" if setup.mode != "colocated"
                    else f"colocated:{setup.decode}", "policy": policy, "simulated": True,
                    "max_num_batched_tokens": batching.budget, "chunked_prefill": chunked_prefill,
                    "preemptions": sum(n.preemptions for n in proxy.prefillers + proxy.decoders)})
    return summary
