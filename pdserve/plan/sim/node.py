"""A simulated node: a request's work on it (Job), its scheduler and step loop (SimNode), and a run
of steady decode steps taken as one event (DecodeRun)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import most_steps
from pdserve.plan.sim.events import Simulation
from pdserve.plan.sim.setup import Batching
from pdserve.plan.sim.tracker import Tracker


class _NoPromptLogprobs:
    prompt_logprobs = None  # what BlockManager.match_prefix reads of a request's sampling params


@dataclass
class Job:
    """A request's work on one node, counted as the engine's Request counts it: `prompt_tokens`, of
    which `context` arrive computed (KV from P), then `output_tokens` tokens, the first sampled by
    the step that computes the last prompt token. A preempted job computes all it has again.

    Its KV blocks are the engine's BlockManager's, which reads the fields a Request has for it
    (block tables, computed tokens, the full blocks' hashes, the ones published)."""

    request_id: int
    prompt_tokens: int
    context: int
    output_tokens: int
    tokens: Tracker | None  # where the tokens go (None: a prefill node's token, which the client never sees)
    on_done: Callable[[float], None]
    hold: bool = False  # P: keep the KV blocks after the last token until the proxy releases them
    num_computed_tokens: int = 0
    generated: int = 0
    hashes: list[int] | None = None  # prefix caching: its full blocks' hashes (prompt, then output tokens)
    block_tables: list[list[int]] = field(default_factory=list)  # BlockManager's: one table (one KV group)
    num_published_blocks: int = 0  # BlockManager's: its leading blocks filed in the prefix cache
    params = _NoPromptLogprobs()

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    block_size: int = 0  # the node's (set on submit)

    @property
    def block_hashes(self) -> list[int]:
        """BlockManager's: the hashes a Request has computed by now (its tokens so far but the last
        sampled one), read from the whole sequence's, known ahead."""
        if not self.hashes:
            return []
        return self.hashes[: max(self.num_tokens - 1, self.num_computed_tokens) // self.block_size]

    @property
    def blocks(self) -> int:
        return len(self.block_tables[0]) if self.block_tables else 0



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
    blocks: BlockManager = field(init=False)
    cached: CachedHashes | None = field(init=False)  # the hashes the prefix cache holds (the proxy's index reads it)
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.cached = CachedHashes() if self.prefix_caching else None
        self.blocks = BlockManager(self.batching.num_blocks, self.batching.block_size, self.prefix_caching,
                                   events=self.cached)

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def cached_prefix(self, job: Job) -> list[list[int]]:
        """job's leading blocks this node's cache holds now (BlockManager.match_prefix's tables)."""
        if self.cached is None or not job.hashes:
            return []
        job.block_size = self.batching.block_size  # (asked before it is submitted: the proxy sizing a pull)
        return self.blocks.match_prefix(job)

    def submit(self, job: Job) -> None:
        if self.batching.blocks_for(job.prompt_tokens + job.output_tokens) > self.batching.num_blocks:
            return  # larger than the whole pool: the engine refuses it (max_model_len <= the pool)
        job.block_size = self.batching.block_size
        if self.cached is not None and job.hashes is not None:
            # The blocks of output nobody asks for again have tokens the simulator never draws: their
            # hashes stand in, one per block, matching nothing (the engine would file real ones).
            full = (job.prompt_tokens + job.output_tokens) // self.batching.block_size
            job.hashes = job.hashes + [("unseen", job.request_id, i) for i in range(len(job.hashes), full)]
        self.waiting.append(job)
        self.outstanding += 1
        if self.run is not None:
            self._cut_run()
        self._maybe_step()

    def release(self, job: Job) -> None:
        """The proxy's word that a held job's KV has left (pulled by D, or pushed)."""
        self._free(job)
        self._maybe_step()

    def _free(self, job: Job) -> None:
        self.blocks.free(job)

    def _publish(self, job: Job) -> None:
        """BlockManager.cache_full_blocks, called only where a block has filled since (the hot path)."""
        if job.num_computed_tokens // self.batching.block_size > job.num_published_blocks:
            self.blocks.cache_full_blocks(job)

    def _preempt(self, job: Job) -> None:
        """Scheduler._preempt: free its blocks; its prompt and output so far are prefilled again."""
        self._free(job)
        job.num_computed_tokens = job.context = 0
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
            remaining = job.prompt_tokens + job.generated - job.num_computed_tokens
            n = min(remaining, budget)
            # (the first test skips the call while the job's last block has room: the hot path)
            while job.num_computed_tokens + n > job.blocks * size and not self.blocks.allocate(job, n):
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
            hit = len(prefix[0]) * size if prefix else 0
            start = max(job.context, hit)  # tokens it has: sent by P, or cached here
            remaining = job.num_tokens - start
            if not limits.chunked and remaining > budget:
                break  # the whole prompt in one step, or wait for the next
            n = min(remaining, budget)
            # The cached blocks shared, new ones for the rest of what P sent and this step's tokens.
            if not self.blocks.allocate(job, start - hit + n, prefix):
                break  # the head of the queue waits for blocks
            self.waiting.popleft()
            job.num_computed_tokens = start
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
        # One step where the next may differ; also where a waiting head could become a prefix-cache
        # hit as these steps fill blocks (Scheduler.steady_decode_steps).
        waits = self.waiting and len(self.running) < self.batching.max_seqs and self.cached is not None
        if chunks or preempted or len(decodes) < len(self.running) or waits:
            seconds = sum(costs.chunk(n, job.num_computed_tokens) for job, n in chunks)
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
            return sum(max(-(-(j.num_computed_tokens + s) // size) - j.blocks, 0) for j in decodes)

        return most_steps(steps, lambda s: needed(s) <= self.free_blocks)

    def _finish_step(self, decodes: list[Job], chunks: list[tuple[Job, int]]) -> None:
        now = self.sim.now
        emitting = list(decodes)
        caching = self.cached is not None
        for job in decodes:
            job.num_computed_tokens += 1
            job.generated += 1
            if caching:
                self._publish(job)
        for job, n in chunks:
            job.num_computed_tokens += n
            if caching:
                self._publish(job)
            if job.num_computed_tokens == job.prompt_tokens + job.generated:  # the prompt is done: its next token
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
            if job.num_computed_tokens + run.steps > job.blocks * size:  # the blocks its steps took, taken at the end
                self.blocks.allocate(job, run.steps)
            job.num_computed_tokens += run.steps
            job.generated += run.steps
            if self.cached is not None:
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


class CachedHashes(set):
    """The hashes a node's prefix cache holds, kept by BlockManager's events (filed, dropped): the
    simulated proxy's prefix index reads it live."""

    def stored(self, block_hash: int) -> None:
        self.add(block_hash)

    def removed(self, block_hash: int) -> None:
        self.discard(block_hash)
