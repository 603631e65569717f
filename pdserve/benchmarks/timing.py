"""Best-of and median timings of the engine and its kernels, for the benchmarks that compare paths in one run."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from pdserve import LLM, SamplingParams
from pdserve.workload import random_prompts


def timed_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """`repeats` calls' times (after one warm-up), in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls (after one warm-up), in ms."""
    return min(timed_ms(fn, repeats))


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed_ms(fn, repeats))


def decode_step_ms(llm: LLM, batch: int, repeats: int, prompt_len: int = 32) -> float:
    """A decode step of `batch` sequences: (time for 64 tokens - time for 1 token) / 63."""
    prompts = random_prompts(batch, prompt_len, seed=batch)
    times = {}
    for n in (1, 64):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        times[n] = best_ms(lambda: llm.generate(prompts, params), repeats)
    return (times[64] - times[1]) / 63


def prefill_ms(llm: LLM, prompt_len: int, repeats: int) -> float:
    """One prompt of `prompt_len` tokens, to its first token (prefix caching off in `llm`)."""
    [prompt] = random_prompts(1, prompt_len, seed=prompt_len)
    return best_ms(lambda: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1)), repeats)
