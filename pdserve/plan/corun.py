"""A twin engine kept busy on another core of this host, to time how much slower a node computes
while another one computes beside it.

`pdserve up` runs every node on its own core of one host. The cores are not independent: they
share caches, memory bandwidth and, on a VM, perhaps a physical core (SMT). A profile measured
with one engine alone predicts the steps of a lone node; two busy nodes may each step slower. The
profile records the ratio (Profile.corun) and the simulator applies it while another node of the
host computes. On the 2-vCPU AMX Xeon where it was first measured it is x1.00: it did not explain
simcheck's low TPOT there (docs/benchmarks.md).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.config import EngineConfig

TWIN_PROMPT, TWIN_BATCH, TWIN_TOKENS = 512, 4, 16  # like speed_index: a 512-token prefill, 4 decoding


def _busy(config: EngineConfig, core: int, ready, stop) -> None:
    os.sched_setaffinity(0, {core})
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.sampling_params import SamplingParams
    from pdserve.workload import random_prompts

    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=TWIN_TOKENS, ignore_eos=True)
    rounds = 0
    try:
        while not stop.is_set():
            for prompt in random_prompts(TWIN_BATCH, TWIN_PROMPT, 9000 + rounds):  # fresh: no prefix hits
                engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            rounds += 1
            ready.set()  # busy from its first round on
    finally:
        engine.close()


@contextmanager
def twin_busy(config: EngineConfig, core: int) -> Iterator[None]:
    """Within the block, a twin of `config`'s engine computes without pause on `core`."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    twin = context.Process(target=_busy, args=(config, core, ready, stop), daemon=True)
    twin.start()
    try:
        if not ready.wait(300):
            raise RuntimeError("the twin engine did not start computing within 300 s")
        yield
    finally:
        stop.set()
        twin.join(120)
        if twin.is_alive():
            twin.kill()
            twin.join()


@contextmanager
def pinned(core: int) -> Iterator[None]:
    """This process on `core` alone within the block (its affinity restored after)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
