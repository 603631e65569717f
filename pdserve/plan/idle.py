"""What a step pays after its node sat idle: the profile's idle penalty.

On some hosts memory left untouched for a while is slow to read again (a VM's host reclaims or
demotes cold pages below the guest: no page faults show in it). An engine reads all its weights
every step, so its first step after an idle spell pays for the cold pages. Measured on a 2-vCPU
Xeon (AMX, 480 MB L3) on 2026-12-07: a one-sequence decode step of 19 ms took 27 ms after 0.1 s
idle, 79 ms after 1 s and 173 ms after 3 s; reading 100 MB of weights with torch alone, 14 ms warm
and 296 ms after 3 s. The profile measures it in-process (steps right after another step cost the
fits' prices) and fits

    excess(gap) = amplitude * (1 - exp(-gap / tau))

with one `tau` and an amplitude for a prefill step and one for a decode step. The simulator adds
it to a node's first step after it idled (SimNode._maybe_step). A host without the effect fits
amplitudes near zero.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time

from pdserve.engine.llm_engine import LLMEngine
from pdserve.plan.measure import timed_step
from pdserve.sampling_params import SamplingParams
from pdserve.workload import random_prompts

GAPS_S = (0.1, 0.3, 1.0, 3.0, 6.0)
PREFILL_TOKENS = 128  # a short prompt: the penalty is what the step pays beyond its warm price
DECODE_CONTEXT = 256
NO_IDLE = {"tau_s": 1.0, "prefill_s": 0.0, "decode_s": 0.0}  # profiles from before it was measured
TAUS_S = [0.05 * 1.15 ** i for i in range(60)]  # 0.05 s to ~190 s


def excess(amplitude_s: float, tau_s: float, gap_s: float) -> float:
    """Seconds a step pays beyond its warm price after its node idled `gap_s`."""
    return amplitude_s * -math.expm1(-gap_s / tau_s) if amplitude_s > 0 and gap_s > 0 else 0.0


def penalty(idle: dict, gap_s: float, prefill: bool) -> float:
    """`excess` for a prefill step or a decode step of the profile's `idle` fit."""
    return excess(idle["prefill_s" if prefill else "decode_s"], idle["tau_s"], gap_s)


def _one_step(engine: LLMEngine) -> float:
    return timed_step(engine)[0]


def _prefill(engine: LLMEngine, seed: int) -> float:
    """One short prompt prefilled whole (its one-token answer sampled)."""
    engine.add_request(random_prompts(1, PREFILL_TOKENS, seed)[0],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    seconds = 0.0
    while engine.has_unfinished_requests():
        seconds += _one_step(engine)
    return seconds


def measure_idle(engine: LLMEngine, seed: int, rounds: int = 3, gaps: tuple[float, ...] = GAPS_S) -> list[dict]:
    """Pairs of steps, one right after another step (warm) and one after `gap` s idle, for a
    short prefill and a one-sequence decode step: their difference is the idle excess. Pairs
    keep the host's drift out of it. ~3 * 2 * sum(gaps) s."""
    samples, seeds = [], itertools.count(seed)  # a prompt seen before would be a prefix-cache hit
    for _ in range(rounds):
        _prefill(engine, next(seeds))  # warm the prefill's own buffers too: the reference step must be warm
        for gap in gaps:
            warm = _prefill(engine, next(seeds))
            time.sleep(gap)
            cold = _prefill(engine, next(seeds))
            samples.append({"kind": "prefill", "gap_s": gap, "warm_s": warm, "cold_s": cold})
        engine.add_request(random_prompts(1, DECODE_CONTEXT, next(seeds))[0],
                           SamplingParams(max_tokens=10 * len(gaps) + 10, temperature=0.0, ignore_eos=True))
        for _ in range(3):  # its prefill, then two decode steps to warm up
            _one_step(engine)
        for gap in gaps:
            warm = _one_step(engine)
            time.sleep(gap)
            cold = _one_step(engine)
            samples.append({"kind": "decode", "gap_s": gap, "warm_s": warm, "cold_s": cold})
        engine.abort_all()
    return samples


def fit_idle(samples: list[dict]) -> dict:
    """tau (shared) and each kind's amplitude, least squares on the medians of each (kind, gap)'s
    excess; amplitudes below zero (no effect, noise) are zero."""
    by_kind: dict[str, dict[float, float]] = {}
    for kind in ("prefill", "decode"):
        by_gap: dict[float, list[float]] = {}
        for s in samples:
            if s["kind"] == kind:
                by_gap.setdefault(s["gap_s"], []).append(s["cold_s"] - s["warm_s"])
        by_kind[kind] = {g: statistics.median(xs) for g, xs in by_gap.items()}
    if not any(by_kind.values()):
        return dict(NO_IDLE)
    best: tuple[float, dict] | None = None
    for tau in TAUS_S:
        fit, sse = {"tau_s": tau}, 0.0
        for kind, points in by_kind.items():
            xs = {g: -math.expm1(-g / tau) for g in points}
            amplitude = max(0.0, sum(xs[g] * y for g, y in points.items()) / sum(x * x for x in xs.values())) \
                if points else 0.0
            fit[f"{kind}_s"] = amplitude
            sse += sum((amplitude * xs[g] - y) ** 2 for g, y in points.items())
        if best is None or sse < best[0]:
            best = (sse, fit)
    return best[1]
