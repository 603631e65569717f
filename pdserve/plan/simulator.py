"""A discrete-event model of pdserve serving a workload, driven by a measured profile.

    pdserve simulate --profile profile.json --setup colocated:2|pull:1P1D|push:1P3D [bench's workload flags]

What it models, as pdserve does it:
- the proxy: colocated (each request to one `--role both` node), pull (P prefills and samples one
  token, D pulls the KV, recomputes the last prompt token and decodes), push (D reserves its blocks
  first, P pushes each layer as it is computed, so only the last layer's transfer follows the
  prefill); nodes picked by round robin or least loaded (outstanding requests);
- each node's scheduler, one step at a time: running decodes first (one token each, up to
  max_num_seqs), then prefill chunks within the token budget (chunked prefill), a request admitted
  only while the KV pool holds its prompt and output (no preemption: admission reserves it all);
- the step's time: the profile's decode-step fit for the decodes plus its prefill-chunk fit for
  each chunk; transfers: the profile's fit for the transport.

It returns the fields `pdserve bench --out` writes (pdserve/workload.py: summarize), so a
simulated and a measured run compare key by key.
"""

from __future__ import annotations

import heapq
import itertools
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
    """A request's work on one node: prefill `prefill_tokens` after `context` cached tokens, then
    emit `output_tokens` tokens (the first at the end of the prefill)."""

    request_id: int
    prefill_tokens: int
    context: int
    output_tokens: int
    on_token: Callable[[float], None]  # called at each token's time
    on_done: Callable[[float], None]
    prefilled: int = 0
    generated: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.context + self.prefilled + self.generated

    @property
    def reserved_tokens(self) -> int:
        return self.context + self.prefill_tokens + self.output_tokens


class Simulation:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


@dataclass(frozen=True)
class Batching:
    """A node's scheduler settings (`pdserve serve`'s --max-num-batched-tokens, --no-chunked-prefill,
    --max-num-seqs) and its KV pool in tokens."""

    budget: int
    chunked: bool
    max_seqs: int
    capacity: int

    @classmethod
    def of(cls, node: dict, budget: int | None = None, chunked: bool = True) -> Batching:
        """The profiled node's settings, with the token budget and chunking a setup asks for.
        Without chunked prefill the budget is at least max_model_len, as the engine makes it."""
        budget = budget or node["max_num_batched_tokens"]
        if budget < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {budget}")
        if not chunked:
            budget = max(budget, node.get("max_model_len", budget))
        return cls(budget, chunked, node["max_num_seqs"], node["kv_capacity_tokens"])


@dataclass
class SimNode:
    """One node's scheduler and clock (pdserve's Scheduler and step loop, in costs)."""

    sim: Simulation
    name: str
    batching: Batching
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    busy: bool = False
    outstanding: int = 0  # requests given to this node and not finished here (least_loaded reads it)

    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        self.outstanding += 1
        self._maybe_step()

    def _maybe_step(self) -> None:
        if self.busy or not (self.waiting or self.running):
            return
        limits = self.batching
        decodes = [j for j in self.running if j.prefilled == j.prefill_tokens][: limits.max_seqs]
        budget = limits.budget - len(decodes)
        chunks: list[tuple[Job, int]] = []
        for job in [j for j in self.running if j.prefilled < j.prefill_tokens]:
            if budget > 0:
                n = min(budget, job.prefill_tokens - job.prefilled)
                chunks.append((job, n))
                budget -= n
        reserved = sum(j.reserved_tokens for j in self.running)
        while (self.waiting and budget > 0 and len(self.running) < limits.max_seqs
               and reserved + self.waiting[0].reserved_tokens <= limits.capacity):
            if not limits.chunked and self.waiting[0].prefill_tokens > budget:
                break  # the whole prompt in one step, or wait for the next
            job = self.waiting.popleft()
            self.running.append(job)
            reserved += job.reserved_tokens
            n = min(budget, job.prefill_tokens)
            chunks.append((job, n))
            budget -= n
        if not decodes and not chunks:
            return  # the head of the queue waits for KV to be freed
        p = self.sim.profile
        seconds = sum(p.prefill_chunk_time(n, j.context + j.prefilled) for j, n in chunks)
        if decodes:
            seconds += p.decode_step_time(len(decodes), sum(j.kv_tokens for j in decodes))  # the fed token included
        self.busy = True
        self.sim.at(self.sim.now + max(seconds, 0.0), lambda: self._finish_step(decodes, chunks))

    def _finish_step(self, decodes: list[Job], chunks: list[tuple[Job, int]]) -> None:
        now = self.sim.now
        emitting = list(decodes)
        for job, n in chunks:
            job.prefilled += n
            if job.prefilled == job.prefill_tokens:
                emitting.append(job)  # the step that ends a prompt samples its first token
        for job in emitting:
            job.generated += 1
            job.on_token(now)
            if job.generated == job.output_tokens:
                self.running.remove(job)
                self.outstanding -= 1
                job.on_done(now)
        self.busy = False
        self._maybe_step()


@dataclass
class Tracker:
    """One request's client-side timings, as `pdserve bench` records them."""

    request: BenchRequest
    arrival: float
    token_times: list[float] = field(default_factory=list)

    def result(self) -> RequestResult:
        times = self.token_times
        if not times:  # never admitted: its prompt and output do not fit a node's KV pool
            return RequestResult(ok=False, input_len=self.request.input_len, start=self.arrival,
                                 error="does not fit the KV pool of any node")
        return RequestResult(ok=len(times) == self.request.output_len, input_len=self.request.input_len,
                             output_len=len(times), ttft_ms=(times[0] - self.arrival) * 1e3,
                             e2el_ms=(times[-1] - self.arrival) * 1e3,
                             itls_ms=[(b - a) * 1e3 for a, b in zip(times, times[1:])], start=self.arrival)


class Proxy:
    def __init__(self, sim: Simulation, setup: Setup, policy: str, transport: str, batching: Batching) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
        node = sim.profile.meta["node"]
        if transport not in sim.profile.transfer:
            raise ValueError(f"--kv-transport {transport!r}: the profile measured {sorted(sim.profile.transfer)}")
        self.sim, self.setup, self.policy, self.transport = sim, setup, policy, transport
        self.kv_bytes_per_token, self.num_layers = node["kv_bytes_per_token"], node["num_layers"]

        self.prefillers = [SimNode(sim, f"P{i}", batching) for i in range(setup.prefill)]
        self.decoders = [SimNode(sim, f"D{i}" if setup.mode != "colocated" else f"N{i}", batching)
                         for i in range(setup.decode)]
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def _pick(self, nodes: list[SimNode], kind: str) -> SimNode:
        if self.policy == "least_loaded":
            return min(nodes, key=lambda n: (n.outstanding, nodes.index(n)))
        return nodes[next(self._turns[kind]) % len(nodes)]

    def arrive(self, rid: int, req: BenchRequest, tracker: Tracker) -> None:
        record = tracker.token_times.append
        if self.setup.mode == "colocated":
            node = self._pick(self.decoders, "decode")
            node.submit(Job(rid, req.input_len, 0, req.output_len, record, lambda t: None))
            return
        decoder_job = Job(rid, 1, req.input_len - 1, req.output_len, record, lambda t: None)
        nbytes = req.input_len * self.kv_bytes_per_token

        def prefilled(t: float) -> None:
            if self.setup.mode == "pull":
                decoder = self._pick(self.decoders, "decode")
                self.sim.at(t + self.profile_transfer(nbytes), lambda: decoder.submit(decoder_job))
            else:  # push: only the last layer's bytes are left to send once the prefill ends
                self.sim.at(t + self.profile_transfer(nbytes / self.num_layers), lambda: push_decoder.submit(decoder_job))

        push_decoder = self._pick(self.decoders, "decode") if self.setup.mode == "push" else None
        prefiller = self._pick(self.prefillers, "prefill")
        prefiller.submit(Job(rid, req.input_len, 0, 1, lambda t: None, prefilled))

    def profile_transfer(self, nbytes: float) -> float:
        return max(self.sim.profile.transfer_time(self.transport, int(nbytes)), 0.0)


def simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
             seed: int, slos: dict[str, float], policy: str = "round_robin", transport: str = "shm",
             max_num_batched_tokens: int | None = None, chunked_prefill: bool = True) -> dict:
    """The summary `pdserve bench` would write for this workload on this setup (pdserve/workload.py).
    Every node runs the profiled node's settings, with the token budget and chunking given here."""
    sim = Simulation(profile)
    batching = Batching.of(profile.meta["node"], max_num_batched_tokens, chunked_prefill)
    proxy = Proxy(sim, setup, policy, transport, batching)
    trackers: list[Tracker] = []
    t = 0.0
    for rid, (req, gap) in enumerate(zip(requests, arrival_gaps(len(requests), rate, burstiness, seed))):
        t += gap
        tracker = Tracker(req, t)
        trackers.append(tracker)
        sim.at(t, lambda rid=rid, req=req, tracker=tracker: proxy.arrive(rid, req, tracker))
    sim.run()
    results = [tr.result() for tr in trackers]
    duration = max((tr.token_times[-1] for tr in trackers if tr.token_times), default=0.0)
    summary = summarize(results, duration, slos)
    summary.update({"setup": f"{setup.mode}:{setup.prefill}P{setup.decode}D" if setup.mode != "colocated"
                    else f"colocated:{setup.decode}", "policy": policy, "simulated": True,
                    "max_num_batched_tokens": batching.budget, "chunked_prefill": chunked_prefill})
    return summary
