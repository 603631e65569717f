"""A twin engine kept busy on another core of this host, to time how much slower a node computes
while another one computes beside it.

`pdserve up` runs every node on its own core of one host. The cores are not independent: they
share caches, memory bandwidth and, on a VM, perhaps a physical core (SMT). A profile measured
with one engine alone predicts the steps of a lone node; two busy nodes may each step slower. The
profile records the ratio (Profile.corun) and the simulator applies it while another node of the
host computes. On the 2-vCPU AMX Xeon where it was first measured it is x1.00: it did not explain
simcheck's low TPOT there (docs/benchmarks.md).

The engines are not all that shares the host: the proxy (and a client) run wherever the OS puts
them and are woken at every streamed token. relay_samples times a pinned node's prefill while
another node's streams are relayed that way, and its decode steps too. The simulator applies each
ratio in proportion to the streams other nodes have under way, up to the RELAY_STREAMS it was
measured at (the decode step's only while another node computes: no core is left idle for the
relay), and the proxy's own hop to every request. In proportion, because a flat factor over-priced
colocated nodes, whose prefill stalls their own streams (simcheck: docs/benchmarks.md).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from pdserve.config import EngineConfig
from pdserve.plan.measure import pinned_pair
from pdserve.procs import Child
from pdserve.workload import random_prompts

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


# -- what the host's relaying of streams costs a pinned node's prefill ---------------------------

RELAY_PROMPT, RELAY_STREAM_TOKENS, RELAY_DECODE_TOKENS = 128, 200, 64
RELAY_STREAMS = 3  # the streams relayed while A is timed: the simulator scales the factors by streams under way


def stream_load(url: str, cores: set[int], streams: int, stop, tokens) -> None:
    """A client on `cores`: `streams` answers at a time from `url`, one after another until `stop`
    (`tokens`, a shared counter, counts the streamed tokens)."""
    os.sched_setaffinity(0, cores)
    body = {"prompt": "Tell me a long story about the sea.", "max_tokens": RELAY_STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def one() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                with client.stream("POST", url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            with tokens.get_lock():
                                tokens.value += 1

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_token_answers(url: str, n: int, seed: int, pause_s: float = 0.0) -> list[tuple[float, httpx.Headers]]:
    """`n` fresh RELAY_PROMPT-token prompts answered with one token, one at a time (`pause_s`
    between them), by one client kept open: (seconds the client waited, the answer's headers)."""
    out = []
    with httpx.Client(timeout=60) as client:
        for ids in random_prompts(n, RELAY_PROMPT, seed):
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0})
            out.append((time.perf_counter() - start, r.raise_for_status().headers))
            time.sleep(pause_s)
    return out


def prefills(url: str, n: int, seed: int) -> list[float]:
    """The node's engine's own prefill (ms) of `n` fresh prompts, one at a time."""
    return [float(h["x-pdserve-ttft-ms"]) - float(h["x-pdserve-queue-ms"])
            for _, h in one_token_answers(url, n, seed, pause_s=0.3)]  # and the load's steps between them


def decode_steps(url: str, n: int, seed: int) -> list[float]:
    """The node's mean decode step (ms) in each of `n` fresh prompts' RELAY_DECODE_TOKENS-token
    answers, one at a time, not streamed: the answer's wait after the node's own TTFT, a step a token
    (the reply's one hop, ~3 ms, spread over them)."""
    body = {"max_tokens": RELAY_DECODE_TOKENS, "temperature": 0, "ignore_eos": True}
    out = []
    with httpx.Client(timeout=120) as client:
        for ids in random_prompts(n, RELAY_PROMPT, seed):
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", json={"prompt": ids, **body}).raise_for_status()
            waited_ms = (time.perf_counter() - start) * 1e3
            out.append((waited_ms - float(r.headers["x-pdserve-ttft-ms"])) / (RELAY_DECODE_TOKENS - 1))
    return out


def timed_beside(url: str, n: int, seed: int, load_url: str | None = None, load_cores: set[int] | None = None,
                 streams: int = RELAY_STREAMS, measure: Callable[[str, int, int], list[float]] = prefills) -> dict:
    """`measure` (`prefills`, or `decode_steps`) of the node at `url` while a client on
    `load_cores` streams from `load_url` (None: no load)."""
    context = multiprocessing.get_context("spawn")
    stop, tokens = context.Event(), context.Value("l", 0)
    client = None
    if load_url is not None:
        client = context.Process(target=stream_load, args=(load_url, load_cores, streams, stop, tokens), daemon=True)
        client.start()
        time.sleep(3)  # the streams under way
    try:
        began, before = time.monotonic(), tokens.value
        ms = measure(url, n, seed)
        rate = (tokens.value - before) / (time.monotonic() - began)
    finally:
        stop.set()
        if client is not None:
            client.join(60)
            if client.is_alive():
                client.kill()
    deciles = statistics.quantiles(ms, n=10)
    return {"ms": ms, "p10_ms": deciles[0], "p50_ms": statistics.median(ms), "p90_ms": deciles[-1],
            "load_tokens_per_s": rate}


def answer_hops_ms(url: str, n: int, seed: int) -> list[float]:
    """One-token answers from `url` (a node, or a colocated proxy in front of one) minus the node's
    engine's own TTFT: x-pdserve-ttft-ms from a node, queue + prefill from a proxy."""
    def engine_ms(h: httpx.Headers) -> float:
        if "x-pdserve-ttft-ms" in h:
            return float(h["x-pdserve-ttft-ms"])
        return float(h["x-pdserve-queue-ms"]) + float(h["x-pdserve-prefill-ms"])

    return [seconds * 1e3 - engine_ms(h) for seconds, h in one_token_answers(url, n, seed)]


def relay_samples(engine_args: list[str], cores: tuple[int, int], prompts: int = 12, streams: int = RELAY_STREAMS,
                  decodes: int = 6, rounds: int = 3) -> dict:
    """As `pdserve up` runs a host: node A pinned to the first core, node B to the second, a proxy
    in front of B on both (the OS places it). The proxy's own hop (one-token answers through it minus
    those from B directly, both idle), then `rounds` rounds of A's prefills and decode steps with the
    second core idle and while B streams `streams` answers through the proxy to a client the OS
    places too. The proxy's processes, woken at every relayed token, find no idle core and land on
    A's: it steps slower. Rounds interleave the two conditions: one round's ratio ranged x1.03-1.17
    (decode) and x1.13-1.36 (prefill) on a 2-vCPU AMD EPYC, as the host drifts and the OS places
    the relay."""
    both = set(cores)
    with pinned_pair(("both", "both"), engine_args, cores) as (group, logs, a, b):
        proxy = Child.on_free_port("proxy", ["proxy", "--mode", "colocated", "--node", b.url], tuple(sorted(both)),
                                   log_path=f"{logs}/proxy.log")
        group.start(proxy)
        group.wait_ready([proxy], 60)
        prefills(a.url, 3, 1)  # warm-up
        answer_hops_ms(proxy.url, 3, 2)
        direct, via_proxy = answer_hops_ms(b.url, prompts, 3), answer_hops_ms(proxy.url, prompts, 4)
        measured = []
        for seed in range(100, 100 + 1000 * rounds, 1000):  # fresh prompts each time: no prefix hits
            idle = timed_beside(a.url, prompts, seed)
            relayed = timed_beside(a.url, prompts, seed + 100, proxy.url, both, streams)
            idle_decode = timed_beside(a.url, decodes, seed + 200, measure=decode_steps)
            relayed_decode = timed_beside(a.url, decodes, seed + 300, proxy.url, both, streams, measure=decode_steps)
            measured.append({"idle_prefill_ms": idle["ms"], "relayed_prefill_ms": relayed["ms"],
                             "relayed_tokens_per_s": relayed["load_tokens_per_s"],
                             "idle_decode_step_ms": idle_decode["ms"], "relayed_decode_step_ms": relayed_decode["ms"]})
    return {"direct_hop_ms": direct, "proxy_hop_ms": via_proxy, "rounds": measured}


def relay_factors(samples: dict) -> dict[str, float]:
    """A's prefill ("relay") and decode step ("relay_decode", where measured) while streams are
    relayed over the same with the other core idle: each round's ratio of medians, the rounds'
    median (profiles before rounds: their one round)."""
    rounds = samples.get("rounds") or [samples]

    def ratio(kind: str) -> float:
        return statistics.median(statistics.median(r[f"relayed_{kind}_ms"]) / statistics.median(r[f"idle_{kind}_ms"])
                                 for r in rounds)

    return {"relay": ratio("prefill"), **({"relay_decode": ratio("decode_step")}
                                          if "idle_decode_step_ms" in rounds[0] else {})}
