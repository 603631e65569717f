"""A discrete-event model of pdserve serving a workload, driven by a measured profile.

    pdserve simulate --profile profile.json --setup colocated:2|pull:1P1D|push:1P3D|auto:8|auto:4P4D [bench's workload flags]

What it models, as pdserve does it:
- the proxy: colocated (each request to one `--role both` node), pull (P prefills and samples one
  token, D pulls the KV its own cache lacks, recomputes the last prompt token and decodes), push
  (D reserves its blocks first, P pushes each layer as it is computed, so only the last layer's
  transfer follows the prefill), auto (the proxy's own Placer, pdserve/proxy/placement.py, run on
  the simulation's clock: per request, the decode node and whether it prefills locally or on a P
  that D then pulls from); nodes picked by round robin or least loaded (outstanding requests);
- each node's scheduler, one step at a time, as pdserve's Scheduler runs it (a test checks the two
  token for token, with and without prefix caching): running requests first, in the order they
  were admitted, then waiting ones within the token budget (chunked prefill) and max_num_seqs; KV
  blocks taken as tokens are computed; when a running request cannot get a block the newest one is
  preempted and later prefilled again with its output so far; a P node holds a prompt's blocks
  until its KV has left (pulled by D, or its last layer pushed); steps that only decode a batch
  that does not change are one event (a decode run, ended early where blocks would run out), so
  the cost of simulating grows with requests, not with tokens;
- the prefix cache, block by block as BlockManager keeps it (hash-chained full blocks, shared while
  in use, evicted least recently freed first), when the workload has conversations, the setup is
  auto, or it is asked for;
- conversations (`--dataset multiturn`) as bench runs them: each turn sent after the previous
  answer and the user's think time, its prompt the history (earlier turns and seeded answers);
- the step's time: the profile's decode-step fit for the decodes plus its prefill-chunk fit for
  each chunk, plus what the server adds per step; each HTTP hop to a node (one colocated, P's and
  D's in pull, P's in push, where D had the request during the prefill) adds the profile's
  per-request serving cost, and streaming delays every token the client sees by its stream cost;
  transfers: the profile's fit for the transport.

Not modelled: D's blocks while a pull is in flight (the transfer is charged before D queues the
request); the proxy's view of the caches lagging the nodes' events (the simulated index is exact);
a bench client's retokenized answers, which may split the last block of an answer differently.

It returns the fields `pdserve bench --out` writes (pdserve/workload.py: summarize), so a
simulated and a measured run compare key by key.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
import re
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from pdserve.kv.prefix_hash import block_hashes
from pdserve.plan.profile import Profile
from pdserve.proxy.costs import CostModel
from pdserve.proxy.placement import Placer
from pdserve.proxy.policies import Node
from pdserve.proxy.prefix_index import NodeCache
from pdserve.workload import BenchRequest, RequestResult, arrival_gaps, conversations, summarize

MODES = ("colocated", "pull", "push", "auto")
POLICIES = ("round_robin", "least_loaded")


@dataclass(frozen=True)
class Setup:
    mode: str
    prefill: int  # P nodes (0 when colocated, or auto over colocated nodes)
    decode: int  # D nodes, or colocated nodes

    @classmethod
    def parse(cls, text: str) -> Setup:
        """`colocated:N`, `pull:xPyD`, `push:xPyD`, `auto:N` (N colocated nodes placed per request)
        or `auto:xPyD` (per request: prefill on D, or on a P then pull); ValueError names what is wrong."""
        mode, _, shape = text.partition(":")
        if mode in ("colocated", "auto") and shape.isdigit() and int(shape) > 0:
            return cls(mode, 0, int(shape))
        match = re.fullmatch(r"(\d+)P(\d+)D", shape)
        if mode in ("pull", "push", "auto") and match and int(match[1]) > 0 and int(match[2]) > 0:
            return cls(mode, int(match[1]), int(match[2]))
        raise ValueError(f"--setup {text!r}: expected colocated:N, pull:xPyD, push:xPyD, auto:N or auto:xPyD "
                         "(e.g. pull:1P3D)")


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
    hashes: list[int] | None = None  # prefix caching: its full blocks' hashes (prompt, then output tokens)
    keys: list[int] = field(default_factory=list)  # prefix caching: its blocks (PrefixCache's keys)
    published: int = 0  # prefix caching: its leading blocks filed in the cache

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


class PrefixCache:
    """BlockManager's prefix cache, block by block: a block is known by its hash once a job has
    computed it full (and no other block holds that hash), by a negative id before. Free blocks are
    handed out as the engine's free list hands them out: never-used ones first, then the least
    recently freed (a job's tail first), which evicts the hash a freed block still held."""

    def __init__(self, num_blocks: int) -> None:
        self.untouched = num_blocks
        self.freed: OrderedDict[int, None] = OrderedDict()
        self.held: dict[int, int] = {}  # hash -> jobs holding its block
        self.hashes: set[int] = set()  # every hash a block holds, in use or free (the proxy's index reads it)
        self._ids = itertools.count(-1, -1)

    def match(self, hashes: list[int], limit: int) -> list[int]:
        """The leading hashes cached, at most `limit` (the engine always computes a prompt's last token)."""
        hit = []
        for h in hashes[:limit]:
            if h not in self.hashes:
                break
            hit.append(h)
        return hit

    def reusable(self, prefix: list[int]) -> int:
        """Blocks of `prefix` now free: taking them shrinks the free count."""
        return sum(1 for h in prefix if h not in self.held)

    def take(self, prefix: list[int]) -> None:
        for h in prefix:
            if h in self.held:
                self.held[h] += 1
            else:
                del self.freed[h]
                self.held[h] = 1

    def hand_out(self, n: int) -> list[int]:
        keys = []
        for _ in range(n):
            if self.untouched:
                self.untouched -= 1
            else:
                key, _ = self.freed.popitem(last=False)
                if key >= 0:  # a cached block handed out again: its prefix is gone
                    self.hashes.discard(key)
            keys.append(next(self._ids))
        return keys

    def publish(self, keys: list[int], hashes: list[int], start: int, end: int) -> None:
        """File blocks start..end of a job (BlockManager.cache_full_blocks)."""
        for i in range(start, end):
            h = hashes[i]
            if keys[i] < 0 and h not in self.hashes:
                keys[i] = h
                self.held[h] = 1
                self.hashes.add(h)

    def give_back(self, keys: list[int]) -> int:
        """A job's blocks, tail first; returns how many became free (shared ones stay held)."""
        freed = 0
        for key in reversed(keys):
            if key >= 0:
                left = self.held[key] - 1
                if left:
                    self.held[key] = left
                    continue
                del self.held[key]
            self.freed[key] = None
            freed += 1
        return freed


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
    prefix_caching: bool = False
    free_blocks: int = field(init=False)
    cache: PrefixCache | None = field(init=False)
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.free_blocks = self.batching.num_blocks
        self.cache = PrefixCache(self.batching.num_blocks) if self.prefix_caching else None

    def cached_prefix(self, job: Job) -> list[int]:
        """The hashes of job's leading blocks this node's cache holds now."""
        if self.cache is None or not job.hashes:
            return []
        return self.cache.match(job.hashes, (job.num_tokens - 1) // self.batching.block_size)

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

    def _allocate(self, job: Job, tokens: int, prefix: list[int] = ()) -> bool:
        """Blocks for `tokens` computed tokens of job, the cached `prefix` blocks first (BlockManager.allocate)."""
        if not prefix:  # the hot path
            needed = self.batching.blocks_for(tokens) - job.blocks
            if needed > self.free_blocks:
                return False
        else:
            needed = self.batching.blocks_for(tokens) - job.blocks - len(prefix)
            reusable = self.cache.reusable(prefix)
            if needed > self.free_blocks - reusable:
                return False
            self.cache.take(prefix)
            job.keys.extend(prefix)
            job.blocks += len(prefix)
            job.published = len(prefix)
            self.free_blocks -= reusable
        if needed > 0:
            job.blocks += needed
            self.free_blocks -= needed
            if self.cache is not None:
                job.keys.extend(self.cache.hand_out(needed))
        return True

    def _free(self, job: Job) -> None:
        if self.cache is not None:
            self.free_blocks += self.cache.give_back(job.keys)
            job.keys, job.published = [], 0
        else:
            self.free_blocks += job.blocks
        job.blocks = 0

    def _publish(self, job: Job) -> None:
        if job.hashes:
            full = min(job.computed // self.batching.block_size, len(job.hashes))
            if full > job.published:
                self.cache.publish(job.keys, job.hashes, job.published, full)
                job.published = full

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
            prefix = self.cached_prefix(job)
            start = max(job.context, len(prefix) * size)  # tokens it has: sent by P, or cached here
            remaining = job.num_tokens - start
            if not limits.chunked and remaining > budget:
                break  # the whole prompt in one step, or wait for the next
            n = min(remaining, budget)
            if not self._allocate(job, start + n, prefix):
                break  # the head of the queue waits for blocks
            self.waiting.popleft()
            job.computed = start
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
        caching = self.cache is not None
        for job in decodes:
            job.computed += 1
            job.generated += 1
            if caching:
                self._publish(job)
        for job, n in chunks:
            job.computed += n
            if caching:
                self._publish(job)
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
            if self.cache is not None:
                self._publish(job)
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


@dataclass
class Prompt:
    """A request as the simulated proxy sees it: its tokens (auto mode places by them) and, with
    prefix caching, the hashes of its full blocks, prompt then answer (what a node's cache files)."""

    token_ids: list[int] | None
    hashes: list[int] | None


class SimIndex:
    """The proxy's PrefixIndex over simulated nodes: each copy is the node's own cache, always in
    sync (a real proxy lags the nodes by the events of a step or two)."""

    def __init__(self, nodes: dict[str, SimNode], block_size: int) -> None:
        self.caches = {url: NodeCache(block_size=block_size, hashes=node.cache.hashes, synced=True)
                       for url, node in nodes.items() if node.cache is not None}

    def cache(self, node: Node) -> NodeCache | None:
        return self.caches.get(node.url)


class SimProxy:
    def __init__(self, sim: Simulation, setup: Setup, policy: str, transport: str, batching: Batching,
                 prefix_caching: bool = False, placement: str = "cost", slos: dict[str, float] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
        node = sim.profile.meta["node"]
        if transport not in sim.profile.transfer:
            raise ValueError(f"--kv-transport {transport!r}: the profile measured {sorted(sim.profile.transfer)}")
        self.sim, self.setup, self.policy, self.transport = sim, setup, policy, transport
        self.kv_bytes_per_token, self.num_layers = node["kv_bytes_per_token"], node["num_layers"]
        fit = dict(zip(sim.profile.transfer[transport].features, sim.profile.transfer[transport].coefficients))
        self._transfer_latency, self._transfer_per_byte = fit["one"], fit["bytes"]  # the hot path's copy of the fit

        self.prefillers = [SimNode(sim, f"P{i}", batching, prefix_caching=prefix_caching)
                           for i in range(setup.prefill)]
        self.decoders = [SimNode(sim, f"D{i}" if setup.prefill else f"N{i}", batching, prefix_caching=prefix_caching)
                         for i in range(setup.decode)]
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        if setup.mode == "auto":  # the proxy's own Placer, on the simulation's clock and nodes
            self.members = {n.name: n for n in self.prefillers + self.decoders}
            self.p_nodes = [Node(n.name, "prefill") for n in self.prefillers]
            self.d_nodes = [Node(n.name, "decode" if setup.prefill else "both") for n in self.decoders]
            costs = replace(CostModel.of(asdict(sim.profile)), chunk_size=batching.budget)
            self.placer = Placer(costs, SimIndex(self.members, batching.block_size), placement, transport=transport,
                                 slos=slos, clock=lambda: sim.now)
            self.placements = {"local": 0, "remote": 0}

    def _pick(self, nodes: list[SimNode], kind: str) -> SimNode:
        if self.policy == "least_loaded":
            return min(nodes, key=lambda n: (n.outstanding, nodes.index(n)))
        return nodes[next(self._turns[kind]) % len(nodes)]

    def arrive(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt,
               on_done: Callable[[float], None]) -> None:
        """Route one request; each HTTP hop to a node costs the profile's serving request_s.
        `on_done(t)`: its last token left the decode node at t."""
        hop, now = self.sim.costs.request_hop, self.sim.now
        if self.setup.mode == "auto":
            self._place(rid, req, tracker, prompt, on_done)
        elif self.setup.mode == "colocated":
            node = self._pick(self.decoders, "decode")
            job = Job(rid, req.input_len, 0, req.output_len, tracker, on_done, hashes=prompt.hashes)
            self.sim.at(now + hop, lambda: node.submit(job))
        elif self.setup.mode == "pull":
            self._pull(rid, req, tracker, prompt, self._pick(self.prefillers, "prefill"), None, on_done)
        else:  # push: D had the request first; only the last layer's bytes follow the prefill
            decoder = self._pick(self.decoders, "decode")
            decoder_job = Job(rid, req.input_len, req.input_len - 1, req.output_len, tracker, on_done,
                              hashes=prompt.hashes)
            nbytes = req.input_len * self.kv_bytes_per_token

            def pushed(t: float) -> None:
                self.sim.at(t + self.profile_transfer(nbytes / self.num_layers),
                            lambda: (prefiller.release(prefill_job), decoder.submit(decoder_job)))

            prefiller = self._pick(self.prefillers, "prefill")
            prefill_job = Job(rid, req.input_len, 0, 1, None, pushed, hold=True, hashes=prompt.hashes)
            self.sim.at(now + hop, lambda: prefiller.submit(prefill_job))

    def _pull(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt, prefiller: SimNode,
              decoder: SimNode | None, on_done: Callable[[float], None],
              on_prefilled: Callable[[], None] = lambda: None) -> None:
        """P prefills and holds the KV; when P answers, the proxy sends the request to D (picked
        then, unless given), which pulls what its own cache lacks; P frees the KV once pulled."""
        hop, n = self.sim.costs.request_hop, req.input_len
        decoder_job = Job(rid, n, n - 1, req.output_len, tracker, on_done, hashes=prompt.hashes)

        def prefilled(t: float) -> None:
            on_prefilled()
            target = decoder or self._pick(self.decoders, "decode")
            held = len(target.cached_prefix(decoder_job)) * target.batching.block_size
            pulled = t + self.profile_transfer((n - held) * self.kv_bytes_per_token) + hop
            self.sim.at(pulled, lambda: (prefiller.release(prefill_job), target.submit(decoder_job)))

        prefill_job = Job(rid, n, 0, 1, None, prefilled, hold=True, hashes=prompt.hashes)
        self.sim.at(self.sim.now + hop, lambda: prefiller.submit(prefill_job))

    def _place(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt,
               on_done: Callable[[float], None]) -> None:
        """Auto mode: the proxy's Placer chooses (placement.py), the flow runs as AutoFlow runs it."""
        for n in self.p_nodes + self.d_nodes:  # what the proxy reads from each node's /metrics
            sim_node = self.members[n.url]
            n.kv_usage = 1.0 - sim_node.free_blocks / sim_node.batching.num_blocks
        placement = self.placer.place(prompt.token_ids, self.p_nodes, self.d_nodes, req.output_len)
        self.placer.dispatched(placement)
        self.placements[placement.choice] += 1
        d, p, load = placement.decoder, placement.prefiller, req.input_len + req.output_len

        def decoded(t: float) -> None:
            d.end(load)
            on_done(t)

        if p is None:
            d.begin(load)
            job = Job(rid, req.input_len, 0, req.output_len, tracker, decoded, hashes=prompt.hashes)
            self.sim.at(self.sim.now + self.sim.costs.request_hop, lambda: self.members[d.url].submit(job))
            return
        p.begin(load)
        self._pull(rid, req, tracker, prompt, self.members[p.url], self.members[d.url], decoded,
                   on_prefilled=lambda: (p.end(load), d.begin(load)))

    def profile_transfer(self, nbytes: float) -> float:
        return max(self._transfer_latency + self._transfer_per_byte * int(nbytes), 0.0)


def prompts_of(requests: list[BenchRequest], seed: int) -> list[list[int]]:
    """Token ids for every request (text prompts, which the simulator does not tokenize, get seeded
    ones of their length), each conversation turn after its history: the previous turn's prompt
    and an answer of seeded tokens."""
    out: list[list[int]] = []
    history: dict[int, list[int]] = {}
    for rid, req in enumerate(requests):
        rng = random.Random(seed * 1_000_003 + rid)
        ids = list(req.prompt) if isinstance(req.prompt, list) else [rng.randrange(1000, 40000)
                                                                     for _ in range(req.input_len)]
        if req.conversation is not None:
            ids = history.get(req.conversation, []) + ids
            history[req.conversation] = ids + [rng.randrange(1000, 40000) for _ in range(req.output_len)]
        out.append(ids)
    return out


def simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
             seed: int, slos: dict[str, float], policy: str = "round_robin", transport: str = "shm",
             max_num_batched_tokens: int | None = None, chunked_prefill: bool = True, itls: bool = True,
             prefix_caching: bool | None = None, placement: str = "cost") -> dict:
    """The summary `pdserve bench` would write for this workload on this setup (pdserve/workload.py).
    Every node runs the profiled node's settings, with the token budget and chunking given here;
    itls=False leaves the per-token gaps out (the planner reads TTFT and TPOT only).

    Conversations (`--dataset multiturn`) run as bench runs them: they arrive at the rate, each
    turn after the previous answer and its think time, its prompt the history so far. Prefix
    caching (as the nodes run by default) is modelled when asked, and by default only when the
    workload has conversations or the setup places by prefix (auto): random prompts share no
    blocks, and hashing them costs the million-request runs time for nothing.
    `placement`: auto mode's rule (`pdserve proxy --placement`), with the SLOs given."""
    collecting = gc.isenabled()
    gc.disable()  # a run makes millions of short-lived objects and no cycles: the collector's passes are pure cost
    try:
        return _simulate(profile, setup, requests, rate, burstiness, seed, slos, policy, transport,
                         max_num_batched_tokens, chunked_prefill, itls, prefix_caching, placement)
    finally:
        if collecting:
            gc.enable()


def _simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
              seed: int, slos: dict[str, float], policy: str, transport: str, max_num_batched_tokens: int | None,
              chunked_prefill: bool, itls: bool, prefix_caching: bool | None, placement: str) -> dict:
    turns = any(req.conversation is not None for req in requests)
    caching = prefix_caching if prefix_caching is not None else setup.mode == "auto" or turns
    sim = Simulation(profile)
    batching = Batching.of(profile.meta["node"], max_num_batched_tokens, chunked_prefill)
    proxy = SimProxy(sim, setup, policy, transport, batching, caching, placement, slos)
    size = batching.block_size
    ids = prompts_of(requests, seed) if caching or turns or setup.mode == "auto" else [None] * len(requests)
    trackers: list[Tracker] = [None] * len(requests)  # type: ignore[list-item]

    def send(rid: int, at: float, then: list[int]) -> None:
        """Request `rid` leaves the client at `at`; `then`: the rest of its conversation, in order."""
        req = requests[rid]
        token_ids = ids[rid]
        if token_ids is not None and len(token_ids) != req.input_len:  # a turn: the history goes first
            req = replace(req, input_len=len(token_ids))
        follows = then and requests[then[0]].conversation is not None
        answer = ids[then[0]][len(token_ids):len(token_ids) + req.output_len] if follows else []
        hashes = block_hashes(token_ids + answer, size) if caching else None
        tracker = trackers[rid] = Tracker(req, at, [] if itls else None)

        def done(t: float) -> None:
            if then:  # the user reads the answer, thinks, and sends the next turn
                nxt = then[0]
                client_done = t + sim.costs.stream_delay
                sim.at(client_done + requests[nxt].think_s, lambda: send(nxt, sim.now, then[1:]))

        sim.at(at, lambda: proxy.arrive(rid, req, tracker, Prompt(token_ids, hashes), done))

    rids = {id(req): rid for rid, req in enumerate(requests)}
    sessions = [[rids[id(req)] for req in session] for session in conversations(requests)]
    t = 0.0
    for session, gap in zip(sessions, arrival_gaps(len(sessions), rate, burstiness, seed)):
        t += gap
        send(session[0], t, session[1:])
    sim.run()
    results = [tr.result(itls, sim.costs.stream_delay) for tr in trackers]
    duration = max((tr.last for tr in trackers if tr.first is not None), default=0.0)
    summary = summarize(results, duration, slos)
    shape = f"{setup.prefill}P{setup.decode}D" if setup.prefill else f"{setup.decode}"
    summary.update({"setup": f"{setup.mode}:{shape}", "policy": policy, "simulated": True,
                    "max_num_batched_tokens": batching.budget, "chunked_prefill": chunked_prefill,
                    "prefix_caching": caching,
                    "preemptions": sum(n.preemptions for n in proxy.prefillers + proxy.decoders)})
    if setup.mode == "auto":
        summary.update({"placement": placement, "placement_counts": dict(proxy.placements)})
    return summary
