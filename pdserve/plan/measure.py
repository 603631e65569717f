"""Measurements a profile and the benchmarks share: KV transfer bandwidth per transport, node start-up.

`bench_backends` moves a SmolLM2-shaped set of blocks (bf16, 30 layers, 16-token blocks) between
two processes with the real connector code: P (`python -m pdserve.plan.measure`, holding the
blocks) and D (the caller), over each transport, contiguous and scattered; memcpy is the same
segments copied within one process. `one_start` times `pdserve serve` from start to healthy and,
asked to, what serving over HTTP adds to the engine's costs (streamed probes); `pull_handoffs`, what
a served pull pair's handoff adds to the bytes' transfer; `timed_step`, one engine step timed whole.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferInbox
from pdserve.kv.pool import KVPool, copy_block_runs
from pdserve.kv.pull import KVReceiver, KVSender, LoadSpec
from pdserve.kv.stats import KVStats
from pdserve.kv.transport import NodeTransports, available
from pdserve.procinfo import rss_mib
from pdserve.procs import Child, ProcessGroup
from pdserve.workload import random_prompts


def timed_step(engine: LLMEngine) -> tuple[float, SchedulerOutput]:
    """One engine step timed whole, as the engine loop runs it: schedule, forward and sample, update
    and detokenize (the profile's prices and its idle penalty both time steps this way)."""
    start = time.perf_counter()
    scheduled = engine.scheduler.schedule()
    sampled = engine.model_runner.run(scheduled)
    engine.scheduler.update_from_output(scheduled, sampled)
    return time.perf_counter() - start, scheduled


LAYERS, BLOCK, KV_HEADS, HEAD_DIM, DTYPE = 30, 16, 3, 64, torch.bfloat16
# A probe's prompt and streamed output, in tokens: 6 probes x 127 gaps sample the tail of a streamed
# gap (serving's gap_excess_s) as far as a 600-token answer's longest gap reaches.
PROBE_PROMPT, PROBE_TOKENS = 128, 128


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    return (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)


def pin_to(core: int) -> None:
    """P and D on different cores, as nodes would be; a machine without that core keeps its affinity."""
    if core in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {core})


BLOCK_BYTES = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2  # one block, every layer's K and V


def blocks_for(mib: float) -> int:
    """Whole blocks in `mib` MiB (at least one)."""
    return max(1, int(mib * 2**20) // BLOCK_BYTES)


def block_layouts(n: int) -> tuple[int, dict[str, list[int]]]:
    """(pool blocks, {layout: P's block ids}) for moving n blocks; the same in both processes."""
    return 4 * n, {"contiguous": list(range(n)), "scattered": random.Random(0).sample(range(4 * n), n)}


def serve_blocks(blocks: int, repeats: int, host: str) -> None:
    """The P process: a shared pool with random contents, holding every request until pulled.

    A separate interpreter (not multiprocessing), so it has its own shared-memory tracker as a
    real prefill node would."""
    pin_to(0)
    total, layouts = block_layouts(blocks)
    pool = KVPool(pool_shape(total), DTYPE, "cpu", shared=True)
    pool.tensor.copy_(torch.randn(pool.shape).to(DTYPE))
    held = HeldBlocks(lease_s=3600)
    for t in available():
        for layout, ids in layouts.items():
            for i in range(repeats):
                held.hold(f"{t}-{layout}-{i}", ids)
    transports = NodeTransports([pool], host)
    sender = KVSender(transports, held, KVStats(), host, 0)
    print(sender.port, pool.shm_name, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    sender.close()
    transports.close()
    pool.close()


def bench_backends(mib: float, repeats: int, names: tuple[str, ...] | None = None,
                   host: str = "127.0.0.1", server_prefix: tuple[str, ...] = (), blocks: int | None = None,
                   here: str = "127.0.0.1") -> dict:
    """GB/s of the transports `names` (default: every one that runs here) and memcpy, moving `mib`
    MiB in whole blocks (or `blocks` blocks). The P process listens on `host`, started behind
    `server_prefix` (e.g. `ip netns exec NS`: P on another host's network); D's own KV host is
    `here` (where its transfer engine listens)."""
    pin_to(1)
    names = available() if names is None else names
    blocks = blocks or blocks_for(mib)
    total, layouts = block_layouts(blocks)
    proc = subprocess.Popen([*server_prefix, sys.executable, "-m", "pdserve.plan.measure", "--blocks", str(blocks),
                             "--repeats", str(repeats), "--host", host], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    port, shm_name = proc.stdout.readline().split()
    local = KVPool(pool_shape(total), DTYPE, "cpu")
    transports, inbox = NodeTransports([local], here), TransferInbox()
    receiver = KVReceiver(transports, KVStats(), inbox, "auto", timeout_s=60)
    n = len(layouts["contiguous"])
    nbytes = n * LAYERS * 2 * local.block_bytes
    results: dict = {"bytes": nbytes, "blocks": n}
    rng = random.Random(1)
    try:
        for layout, ids in layouts.items():
            dst = rng.sample(range(total), n) if layout == "scattered" else list(range(n))
            for transport in names:
                receiver.transport = transport
                times = []
                for i in range(repeats):
                    spec = LoadSpec(f"d{i}", [dst], [ids], f"{transport}-{layout}-{i}", host, int(port), (transport,))
                    start = time.perf_counter()
                    receiver.start(spec)
                    res = inbox.poll(timeout=60)
                    assert res[0].error is None, res[0].error
                    times.append(time.perf_counter() - start)
                results[f"{transport}_{layout}_gbps"] = nbytes / min(times) / 1e9
            remote = KVPool(pool_shape(total), DTYPE, "cpu", shm_name=shm_name)  # memcpy reference: same segments
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                copy_block_runs(remote.tensor, ids, local.tensor, dst)
                times.append(time.perf_counter() - start)
            results[f"memcpy_{layout}_gbps"] = nbytes / min(times) / 1e9
            remote.close()
    finally:
        receiver.close()
        transports.close()
        proc.stdin.close()
        proc.wait(30)
    return results


def node_args(dtype: str, model: str | None = None) -> list[str]:
    """`pdserve serve`'s flags for a profiled node: the engine's dtype and model, one thread."""
    return ["--dtype", dtype, "--threads", "1"] + (["--model", model] if model else [])


def one_start(dtype: str, model: str | None = None, probes: int = 0) -> dict:
    """Start `pdserve serve` (one thread, pinned): seconds to healthy, idle RSS, and with `probes`
    that many `probe`s sent one at a time (one more first, to warm up)."""
    node = Child.on_free_port("node", ["serve", *node_args(dtype, model)], cores=(0,), log_path=os.devnull)
    with ProcessGroup(stop_grace_s=30) as group:
        start = time.perf_counter()
        group.start(node)
        group.wait_ready([node], 600, poll_s=0.05)
        ready_s = time.perf_counter() - start
        time.sleep(1.0)
        out = {"startup_s": ready_s, "idle_rss_mib": rss_mib(node.proc.pid)}
        if probes:
            # one client kept open, as the proxy keeps its: a client made per request adds ~20 ms
            # here (its TLS context), which the first profiles counted as every HTTP hop's cost
            with httpx.Client(timeout=120) as client:
                timings = [probe(client, node.url, prompt) for prompt in random_prompts(probes + 1, PROBE_PROMPT, 77)]
            out["probes"] = timings[1:]
        return out


def probe(client: httpx.Client, url: str, prompt: list[int]) -> dict:
    """As a client sees them: the latency of a one-token answer not streamed (how the proxy asks a
    P node) and, of it, the node's engine's own TTFT (its x-pdserve-ttft-ms); then TTFT and TPOT of
    a streamed completion of PROBE_TOKENS tokens (another prompt of the same length: the same one
    would hit the prefix cache)."""
    body = {"prompt": prompt[::-1], "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    answer = client.post(f"{url}/v1/completions", json=body)
    reply_s = time.perf_counter() - start
    answer.raise_for_status()
    body = {"prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"probe: {len(times)} streamed chunks for {PROBE_TOKENS} tokens")
    return {"prompt_tokens": len(prompt), "reply_s": reply_s,
            "engine_ttft_s": float(answer.headers["x-pdserve-ttft-ms"]) / 1e3, "ttft_s": times[0] - start,
            "tpot_s": (times[-1] - times[0]) / (PROBE_TOKENS - 1),
            "gaps_s": [round(b - a, 6) for a, b in zip(times, times[1:])]}


@contextmanager
def pinned_pair(roles: tuple[str, str], engine_args: list[str],
                cores: tuple[int, int]) -> Iterator[tuple[ProcessGroup, str, Child, Child]]:
    """Two served nodes of `roles`, the first pinned to the first core and the second to the second
    (as `pdserve up` runs a host), ready: (their group, a log directory removed after, the nodes)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-pair-") as logs, ProcessGroup() as group:
        nodes = [Child.on_free_port(f"{role}-{i}", ["serve", "--role", role, *engine_args], (core,),
                                    log_path=f"{logs}/{role}-{i}.log")
                 for i, (role, core) in enumerate(zip(roles, cores))]
        for child in nodes:
            group.start(child)
        group.wait_ready(nodes, 600)
        yield group, logs, nodes[0], nodes[1]


def pull_handoffs(engine_args: list[str], cores: tuple[int, int], prompts: int = 20) -> list[dict]:
    """A pull pair as `pdserve up` runs one on this host: P (`--role prefill`) pinned to the first
    core, D (`--role decode`) to the second, each asked directly as the proxy asks them. For each of
    `prompts` fresh PROBE_PROMPT-token prompts, one at a time (one more first, to warm up): D's wait
    for the KV (x-pdserve-kv-load-ms: from D's reservation to its loop reading the finished pull,
    the side channel's round trips and D's loader thread included), the bytes it moved and the
    transport that moved them."""
    with pinned_pair(("prefill", "decode"), engine_args, cores) as (_, _, p, d):
        out = []
        with httpx.Client(timeout=120) as client:
            for ids in random_prompts(prompts + 1, PROBE_PROMPT, 55):
                body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
                held = client.post(f"{p.url}/v1/completions",
                                   json={**body, "kv_transfer_params": {"do_remote_decode": True}}).raise_for_status()
                kv = held.json()["kv_transfer_params"]
                answer = client.post(f"{d.url}/v1/completions",
                                     json={**body, "max_tokens": 2, "kv_transfer_params": kv}).raise_for_status()
                out.append({"kv_load_s": float(answer.headers["x-pdserve-kv-load-ms"]) / 1e3,
                            "kv_bytes": int(answer.headers["x-pdserve-kv-bytes"]),
                            "transport": answer.headers["x-pdserve-kv-transport"]})
        return out[1:]


if __name__ == "__main__":  # the P side of bench_backends
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    serve_blocks(args.blocks, args.repeats, args.host)
