"""KV transfer benchmark: each backend's GB/s against memcpy, and the transfer's share of TTFT.

    python -m pdserve.benchmarks.transfer [--mib 64] [--repeats 5] [--prompt-lens 512 2048]
                                          [--sweep-tokens 16 128 1024 4096]

Part 1 moves a SmolLM2-shaped set of blocks between two processes with the real connector code,
over every transport that runs here (tcp, shared memory, Mooncake and NIXL where they are
installed), contiguous and scattered, against memcpy of the same segments
(pdserve.plan.measure.bench_backends, which profiles use too). Part 2 starts real P and D nodes
(one core each) and measures, for 512- and 2048-token prompts, TTFT = P's prefill request + D's time to its first streamed token,
and how much of it was the KV transfer (D's x-pdserve-kv-load-ms).
Writes docs/results/transfer.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
import torch

from pdserve.benchmarks.report import publish
from pdserve.kv.transport import available
from pdserve.plan.measure import BLOCK, bench_backends
from pdserve.platform import CpuInfo, plan_kernels


def bench_ttft(prompt_lens: list[int], repeats: int, dtype: str) -> dict:
    from pdserve.procs import Child, ProcessGroup, cluster_env

    common = ["--dtype", dtype, "--threads", "1", "--log-level", "warning"]
    nodes = {"p": Child.on_free_port("p", ["serve", "--role", "prefill", *common], (0,))}
    for transport in available():  # a D node pulling over each (mooncake where its engine is installed)
        nodes[transport] = Child.on_free_port(f"d-{transport}", ["serve", "--role", "decode", "--kv-transport",
                                                                  transport, *common], (1,))
    cluster = ProcessGroup(cluster_env())
    out: dict = {}
    try:
        cluster.launch(list(nodes.values()), 300)
        g = torch.Generator().manual_seed(0)
        with httpx.Client(timeout=600) as client:
            for length in prompt_lens:
                for transport in available():
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


def sweep(tokens: list[int], repeats: int) -> dict:
    """Per request size (its prompt tokens, whole blocks of 16): ms per request and GB/s of each
    transport, contiguous and scattered blocks."""
    out = {}
    for n in tokens:
        res = bench_backends(0, repeats, blocks=max(1, n // BLOCK))
        out[str(n)] = {"bytes": res["bytes"], **{k: v for k, v in res.items() if k.endswith("_gbps")}}
    return out


def markdown(res: dict, args) -> str:
    b = res["backends"]
    lines = [
        f"Command: `python -m pdserve.benchmarks.transfer --mib {args.mib} --repeats {args.repeats}` "
        f"({res['date']}; {res.get('cpu', 'CPU not recorded')}; P and D pinned to different cores).",
        "",
        f"Moving {b['bytes'] / 2**20:.0f} MiB ({b['blocks']} blocks x 30 layers x K/V, bf16) from P to D:",
        "",
        "| backend | contiguous blocks GB/s | scattered blocks GB/s |",
        "|---|---|---|",
    ]
    for name in ("memcpy", *available()):
        lines.append(f"| {name} | {b[f'{name}_contiguous_gbps']:.2f} | {b[f'{name}_scattered_gbps']:.2f} |")
    if res.get("sweep"):
        names = ("memcpy", *available())
        lines += ["", "Time per request by its size (prompt tokens, whole 16-token blocks), ms, contiguous / "
                  "scattered blocks (GB/s in docs/results/transfer.json):", "",
                  "| tokens | MiB | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for tokens, row in res["sweep"].items():
            ms = [f"{row['bytes'] / row[f'{n}_contiguous_gbps'] / 1e6:.2f} / "
                  f"{row['bytes'] / row[f'{n}_scattered_gbps'] / 1e6:.2f}" for n in names]
            lines.append(f"| {tokens} | {row['bytes'] / 2**20:.2f} | " + " | ".join(ms) + " |")
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
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[16, 128, 1024, 4096],
                        help="request sizes (prompt tokens) to time each transport at (none: skip)")
    parser.add_argument("--dtype", default="auto", help="auto: what this CPU runs fastest (see pdserve.platform)")
    parser.add_argument("--out", default="docs/results/transfer.json")
    args = parser.parse_args()
    args.dtype = plan_kernels(args.dtype).dtype  # named in the report, passed to every node
    cpu = CpuInfo.detect()
    res = {"date": time.strftime("%Y-%m-%d"), "cpu": f"{cpu.model}, {cpu.isa}",
           "backends": bench_backends(args.mib, args.repeats), "sweep": sweep(args.sweep_tokens, args.repeats),
           "ttft": bench_ttft(args.prompt_lens, max(args.repeats // 2, 2), args.dtype)}
    publish(res, args.out, "transfer", "KV transfer: backends and share of TTFT", markdown(res, args))


if __name__ == "__main__":
    main()
