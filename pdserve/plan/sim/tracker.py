"""One request's client-side timings in a simulation, as `pdserve bench` records them."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pdserve.plan.profile import sorted_quantile
from pdserve.workload import BenchRequest, RequestResult


@dataclass
class GapJitter:
    """What a streamed gap adds to the simulated step, drawn from what the profile's probes saw
    (serving's gap_excess_s: each gap minus its stream's median, sorted). A simulated step is exact,
    but a real stream's longest gap is the tail of hundreds of gaps (the engine loop, the node's
    and the proxy's event loops, the OS's time slices): without it, an ITL SLO looked met by
    requests whose real longest gap was twice as long."""

    excess: Sequence[float]
    rng: random.Random

    def longest(self, mean_gap: float, gaps: int) -> float:
        """The longest of `gaps` gaps of `mean_gap` plus a draw each: one draw of their maximum (the
        u ** (1 / gaps) quantile of the excess, for u uniform)."""
        if not self.excess or gaps < 1:
            return mean_gap
        quantile = self.rng.random() ** (1.0 / gaps)
        return mean_gap + sorted_quantile(self.excess, quantile)

    def add(self, gaps_ms: list[float]) -> list[float]:
        """Each gap plus a draw of the excess (which may be negative: a gap after a late one is short)."""
        if not self.excess:
            return gaps_ms
        return [max(g + e * 1e3, 0.0) for g, e in zip(gaps_ms, self.rng.choices(self.excess, k=len(gaps_ms)))]


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
    longest: float = 0.0  # the longest gap so far (kept even when the gaps are not)
    # Called once, when the longest gap first passes `limit` (auto's proxy counts such streams)
    limit: float = float("inf")
    on_past_limit: Callable[[], None] | None = None
    on_first: Callable[[float], None] | None = None  # called at its first token (auto's proxy marks its Stream)
    jitter: GapJitter | None = None  # what the client's gaps add to the engine's (None: nothing)
    stages: dict[str, float] = field(default_factory=dict)  # ms, as the proxy's x-pdserve-*-ms headers split TTFT
    _client_longest: float | None = None  # the longest gap with its jitter, drawn once

    def token(self, time: float) -> None:
        if self.first is None:
            self.first = time
            if self.on_first is not None:
                self.on_first(time)
        else:
            self._longest(time - self.last)
            if self.gaps is not None:
                self.gaps.append((time - self.last, 0.0, 1))
        self.last, self.count = time, self.count + 1

    def steps(self, end: float, first_step: float, growth: float, count: int, lead: float = 0.0) -> None:
        """`count` tokens from back-to-back decode steps ending at `end` (the first token came before);
        `lead`: what the first of them paid beyond its step (its node's first step after idling,
        Costs.after_idle), a gap of its own."""
        if lead > 0:
            self.token(self.last + lead + first_step)
            first_step, count = first_step + growth, count - 1
            if count == 0:
                self.last = end
                return
        self._longest(first_step + max(growth, 0.0) * (count - 1))
        if self.gaps is not None:
            self.gaps.append((first_step, growth, count))
        self.last, self.count = end, self.count + count

    @property
    def past_limit(self) -> bool:
        return self.longest > self.limit

    def _longest(self, gap: float) -> None:
        was_past = self.past_limit
        self.longest = max(self.longest, gap)
        if self.on_past_limit is not None and self.past_limit and not was_past:
            self.on_past_limit()

    def result(self, itls: bool = True, delay: float = 0.0) -> RequestResult:
        """`delay`: what streaming adds between the node and the client, to every token."""
        if self.first is None:  # never admitted: its prompt and output do not fit a node's KV pool
            return RequestResult(ok=False, input_len=self.request.input_len, start=self.arrival,
                                 error="does not fit the KV pool of any node")
        gaps = [(a + g * j) * 1e3 for a, g, n in self.gaps for j in range(n)] if itls and self.gaps else []
        if gaps and self.jitter is not None:
            gaps = self.jitter.add(gaps)
        return RequestResult(ok=self.count == self.request.output_len, input_len=self.request.input_len,
                             output_len=self.count, ttft_ms=(self.first + delay - self.arrival) * 1e3,
                             e2el_ms=(self.last + delay - self.arrival) * 1e3, itls_ms=gaps, start=self.arrival,
                             longest_gap_ms=max(gaps) if gaps else self.client_longest * 1e3, stages_ms=self.stages)

    @property
    def client_longest(self) -> float:
        """The longest gap as the client would see it: the engine's, or the mean gap plus the longest
        jitter of as many gaps, drawn once (an early look and the result agree)."""
        if self.jitter is None or self.count < 2:
            return self.longest
        if self._client_longest is None:
            gaps = self.count - 1
            self._client_longest = max(self.longest, self.jitter.longest((self.last - self.first) / gaps, gaps))
        return self._client_longest
