"""KV transfer benchmark: each backend's GB/s against memcpy, and the transfer's share of TTFT.

    python -m pdserve.benchmarks.transfer [--mib 64] [--repeats 5] [--prompt-lens 512 2048]

Part 1 moves a SmolLM2-shaped set of blocks (bf16, 30 layers, 16-token blocks) between two
processes: P (a child process holding the blocks) and D (this process) pull them with the real
connector code, over tcp and over shared memory, contiguous and scattered; memcpy is the same
segments copied within one process. Part 2 starts real P and D nodes (one core each) and measures,
for 512- and 2048-token prompts, TTFT = P's prefill request + D's time to its first streamed token,
and how much of it was the KV transfer (D's x-pdserve-kv-load-ms).
Writes docs/results/transfer.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

import httpx
import torch

from pdserve.benchmarks.report import publish
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.pool import KVPool, RemotePool
from pdserve.kv.pull import KVReceiver, KVSender, LoadSpec
from pdserve.kv.results import TransferInbox
from pdserve.kv.stats import KVStats
from pdserve.kv.transport import TRANSPORTS, Transports
from pdserve.platform import plan_kernels

LAYERS, BLOCK, KV_HEADS, HEAD_DIM, DTYPE = 30, 16, 3, 64, torch.bfloat16


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    return (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)


def pin_to(core: int) -> None:
    """P and D on different cores, as nodes would be; a machine without that core keeps its affinity."""
    if core in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {core})


def block_layouts(mib: int) -> tuple[int, dict[str, list[int]]]:
    """(pool blocks, {layout: P's block ids}) for moving `mib` MiB; the same in both processes."""
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * 2
    n = mib * 2**20 // (LAYERS * 2 * block_bytes)
    return 4 * n, {"contiguous": list(range(n)), "scattered": random.Random(0).sample(range(4 * n), n)}


def serve_blocks(mib: int, repeats: int) -> None:
    """The P process: a shared pool with random contents, holding every request until pulled.

    A separate interpreter (not multiprocessing), so it has its own shared-memory tracker as a
    real prefill node would."""
    pin_to(0)
    total, layouts = block_layouts(mib)
    pool = KVPool(pool_shape(total), DTYPE, "cpu", shared=True)
    pool.tensor.copy_(torch.randn(pool.shape).to(DTYPE))
    held = HeldBlocks(timeout_s=3600)
    for t in TRANSPORTS:
        for layout, ids in layouts.items():
            for i in range(repeats):
                held.hold(f"{t}-{layout}-{i}", ids)
    transports = Transports(pool)
    sender = KVSender(pool, transports, held, KVStats(), "127.0.0.1", 0)
    print(sender.port, pool.shm_name, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    sender.close()
    transports.close()
    pool.close()


def bench_backends(mib: int, repeats: int) -> dict:
    pin_to(1)
    total, layouts = block_layouts(mib)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.benchmarks.transfer", "--serve-blocks",
                             "--mib", str(mib), "--repeats", str(repeats)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    port, shm_name = proc.stdout.readline().split()
    local = KVPool(pool_shape(total), DTYPE, "cpu")
    transports, inbox = Transports(local), TransferInbox()
    receiver = KVReceiver(local, transports, KVStats(), inbox, "auto", timeout_s=60)
    n = len(layouts["contiguous"])
    nbytes = n * LAYERS * 2 * local.block_bytes
    results: dict = {"bytes": nbytes, "blocks": n}
    rng = random.Random(1)
    try:
        for layout, ids in layouts.items():
            dst = rng.sample(range(total), n) if layout == "scattered" else list(range(n))
            for transport in TRANSPORTS:
                receiver.transport = transport
                times = []
                for i in range(repeats):
                    spec = LoadSpec(f"d{i}", dst, ids, f"{transport}-{layout}-{i}", "127.0.0.1", int(port), shm_name)
                    start = time.perf_counter()
                    receiver.start(spec)
                    res = inbox.poll(timeout=60)
                    assert res[0].error is None, res[0].error
                    times.append(time.perf_counter() - start)
                results[f"{transport}_{layout}_gbps"] = nbytes / min(times) / 1e9
            remote = RemotePool(shm_name, pool_shape(total), DTYPE)  # memcpy reference: same segments
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                remote.copy_blocks(ids, local, dst)
                times.append(time.perf_counter() - start)
            results[f"memcpy_{layout}_gbps"] = nbytes / min(times) / 1e9
            remote.close()
    finally:
        receiver.close()
        transports.close()
        proc.stdin.close()
        proc.wait(30)
    return results


def bench_ttft(prompt_lens: list[int], repeats: int, dtype: str) -> dict:
    from pdserve.procs import Child, ProcessGroup, cluster_env

    common = ["--dtype", dtype, "--threads", "1", "--log-level", "warning"]
    nodes = {
        "p": Child.on_free_port("p", ["serve", "--role", "prefill", *common], 0),
        "tcp": Child.on_free_port("d-tcp", ["serve", "--role", "decode", "--kv-transport", "tcp", *common], 1),
        "shm": Child.on_free_port("d-shm", ["serve", "--role", "decode", "--kv-transport", "shm", *common], 1),
    }
    cluster = ProcessGroup(cluster_env())
    out: dict = {}
    try:
        cluster.launch(list(nodes.values()), 300)
        g = torch.Generator().manual_seed(0)
        with httpx.Client(timeout=600) as client:
            for length in prompt_lens:
                for transport in ("tcp", "shm"):
                    rows = []
                    for _ in range(repeats + 1):  # the first run warms up this shape
                        prompt = torch.randint(1000, 40000, (length,), generator=g).tolist()
                        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "kv_transfer_params": {"do_remote_decode": True}}
                        start = time.perf_counter()
                        p = client.post(nodes["p"].url + "/v1/completions", json=body)
                        prefill_s = time.perf_counter() - start
                        kv = p.json()["kv_transfer_params"]
                        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "kv_transfer_params": kv}
                        with client.stream("POST", nodes[transport].url + "/v1/completions", json=body) as d:
                            load_s = float(d.headers["x-pdserve-kv-load-ms"]) / 1e3
                            lines = d.iter_lines()
                            next(line for line in lines if line.startswith("data:"))
                            ttft = time.perf_counter() - start
                            for _ in lines:
                                pass
                        rows.append({"ttft_s": ttft, "prefill_s": prefill_s, "transfer_s": load_s})
                    rows = rows[1:]
                    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                    med["transfer_share"] = med["transfer_s"] / med["ttft_s"]
                    out[f"{transport}_{length}"] = med
    finally:
        cluster.stop()
    return out


def markdown(res: dict, args) -> str:
    b = res["backends"]
    lines = [
        f"Command: `python -m pdserve.benchmarks.transfer --mib {args.mib} --repeats {args.repeats}` "
        f"({res['date']}; P and D pinned to different cores).",
        "",
        f"Moving {b['bytes'] / 2**20:.0f} MiB ({b['blocks']} blocks x 30 layers x K/V, bf16) from P to D:",
        "",
        "| backend | contiguous blocks GB/s | scattered blocks GB/s |",
        "|---|---|---|",
    ]
    for name in ("memcpy", "shm", "tcp"):
        lines.append(f"| {name} | {b[f'{name}_contiguous_gbps']:.2f} | {b[f'{name}_scattered_gbps']:.2f} |")
    lines += ["", "Transfer time inside TTFT (real P and D nodes, median of the runs):", "",
              "| prompt tokens | transport | TTFT (ms) | P prefill request (ms) | KV transfer (ms) | transfer share |",
              "|---|---|---|---|---|---|"]
    for key, row in res["ttft"].items():
        transport, length = key.split("_")
        lines.append(f"| {length} | {transport} | {row['ttft_s'] * 1e3:.0f} | {row['prefill_s'] * 1e3:.0f} | "
                     f"{row['transfer_s'] * 1e3:.1f} | {row['transfer_share'] * 100:.1f} % |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtype", default="auto", help="auto: what this CPU runs fastest (see pdserve.platform)")
    parser.add_argument("--out", default="docs/results/transfer.json")
    parser.add_argument("--serve-blocks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = plan_kernels(args.dtype).dtype  # named in the report, passed to every node
    if args.serve_blocks:
        serve_blocks(args.mib, args.repeats)
        return
    res = {"date": time.strftime("%Y-%m-%d"), "backends": bench_backends(args.mib, args.repeats),
           "ttft": bench_ttft(args.prompt_lens, max(args.repeats // 2, 2), args.dtype)}
    publish(res, args.out, "transfer", "KV transfer: backends and share of TTFT", markdown(res, args))


if __name__ == "__main__":
    main()
