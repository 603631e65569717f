"""Soak: many short requests through `pdserve up` at a steady rate; nothing may grow or leak.

    python -m pdserve.benchmarks.soak [--requests 10000] [--rate 20] [--mode pull|push]

Starts `pdserve up` (1P1D), warms it up, records every process's RSS, sends `--requests` short
requests (16-48 prompt tokens, 2-6 output tokens, Poisson arrivals), waits until idle and records
again. Pass: 0 errors, every process's RSS grew < 5 %, and P's and D's KV blocks (used and held)
are back to their baseline. Writes docs/results/soak.json (soak_push.json with `--mode push`)
and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from pdserve.benchmarks.push import metric_sum
from pdserve.benchmarks.report import publish
from pdserve.bench_serving import run_benchmark
from pdserve.platform import plan_kernels
from pdserve.procinfo import alive, children, rss_mib
from pdserve.procs import ProcessGroup, up_child
from pdserve.workload import random_dataset

MAX_RSS_GROWTH = 0.05
BLOCK_METRICS = ("pdserve:kv_blocks_used", "pdserve:kv_blocks_held")


def process_name(pid: int) -> str:
    """`prefill`, `decode`, `proxy` or `up`, from the process's command line."""
    args = open(f"/proc/{pid}/cmdline").read().split("\0")
    if "--role" in args:
        return args[args.index("--role") + 1]
    return "proxy" if "proxy" in args else "up"


def cluster_processes(up_pid: int) -> dict[str, int]:
    """`pdserve up` and the P, D and proxy processes it started; another child of it (a helper that
    comes and goes) is none of them and would otherwise take `up`'s name."""
    pids = {"up": up_pid}
    for pid in children(up_pid):
        try:
            name = process_name(pid)
        except FileNotFoundError:  # gone since it was listed
            continue
        if name != "up":
            pids[name] = pid
    return pids


def rss_or_nan(pid: int) -> float:
    """A process that died has no RSS: NaN, and the verdict's `processes_alive_at_end` says why."""
    try:
        return rss_mib(pid)
    except FileNotFoundError:
        return float("nan")


def blocks(urls: list[str]) -> dict[str, float]:
    return {f"{url} {name}": metric_sum(url, name) for url in urls for name in BLOCK_METRICS}


def wait_idle(proxy_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = httpx.get(proxy_url + "/v1/nodes", timeout=10).json()["nodes"]
        if all(n["active_requests"] == 0 for n in nodes):
            return
        time.sleep(0.5)


def run(args) -> dict:
    with ProcessGroup(stop_grace_s=30) as group:
        up = group.start(up_child(("--mode", args.mode, "--dtype", args.dtype)))
        group.wait_ready([up], 300)
        pids = cluster_processes(up.proc.pid)
        node_urls = [n["url"] for n in httpx.get(up.url + "/v1/nodes", timeout=10).json()["nodes"]]
        warm = random_dataset(args.warmup, 32, 4, 0.5, seed=1)
        asyncio.run(run_benchmark(up.url, warm, "completions", None, args.rate, 1.0, None, 1, show_progress=False))
        wait_idle(up.url)
        rss_start = {name: rss_or_nan(pid) for name, pid in pids.items()}
        blocks_start = blocks(node_urls)
        requests = random_dataset(args.requests, 32, 4, 0.5, seed=2)
        results, duration = asyncio.run(run_benchmark(up.url, requests, "completions", None, args.rate, 1.0, None, 2))
        wait_idle(up.url)
        time.sleep(args.settle)
        rss_end = {name: rss_or_nan(pid) for name, pid in pids.items()}
        blocks_end = blocks(node_urls)
        running = {name: up.proc.poll() is None if name == "up" else alive(pid) for name, pid in pids.items()}
    errors = [r.error for r in results if not r.ok]
    growth = {name: rss_end[name] / rss_start[name] - 1 for name in rss_start}
    return {
        "mode": args.mode, "requests": args.requests, "rate": args.rate, "duration_s": duration, "pids": pids,
        "achieved_rate": len(results) / duration, "errors": len(errors), "first_errors": errors[:5],
        "rss_start_mib": rss_start, "rss_end_mib": rss_end, "rss_growth": growth,
        "blocks_start": blocks_start, "blocks_end": blocks_end, "processes_alive_at_end": running,
        "median_e2el_ms": sorted(r.e2el_ms for r in results if r.ok)[len(results) // 2] if results else None,
        "pass": (not errors and all(g < MAX_RSS_GROWTH for g in growth.values()) and blocks_end == blocks_start
                 and all(running.values())),
    }


def markdown(res: dict, args) -> str:
    lines = [
        f"Command: `python -m pdserve.benchmarks.soak --requests {args.requests} --rate {args.rate:g} --mode {args.mode}` "
        f"({time.strftime('%Y-%m-%d')}, {args.dtype}; `pdserve up` 1P1D; prompts of 16-48 random tokens, 2-6 output tokens, "
        f"Poisson arrivals; RSS after {args.warmup} warm-up requests and after the run).",
        "",
        f"{res['requests']} requests in {res['duration_s']:.0f} s ({res['achieved_rate']:.1f} req/s), "
        f"**{res['errors']} errors**, median latency {res['median_e2el_ms']:.0f} ms. Result: "
        f"**{'pass' if res['pass'] else 'FAIL'}** (0 errors, RSS growth < 5 %, blocks back to baseline).",
        "",
        "| process | RSS at start (MiB) | RSS at end (MiB) | growth |",
        "|---|---|---|---|",
    ]
    for name in res["rss_start_mib"]:
        lines.append(f"| {name} | {res['rss_start_mib'][name]:.0f} | {res['rss_end_mib'][name]:.0f} | "
                     f"{res['rss_growth'][name] * 100:+.2f} % |")
    lines += ["", "| KV blocks | at start | at end |", "|---|---|---|"]
    for key, value in res["blocks_start"].items():
        lines.append(f"| {key} | {value:.0f} | {res['blocks_end'][key]:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds idle before the last RSS reading")
    parser.add_argument("--mode", default="pull", choices=["pull", "push"])
    parser.add_argument("--dtype", default="auto", help="auto: what this CPU runs fastest (see pdserve.platform)")
    parser.add_argument("--out", default=None, help="default: docs/results/soak.json (pull), soak_push.json (push)")
    args = parser.parse_args()
    args.dtype = plan_kernels(args.dtype).dtype  # named in the report, passed to every node
    if args.requests < 1 or args.rate <= 0:
        parser.error("--requests must be >= 1 and --rate > 0")
    res = run(args)
    # Each mode keeps its own results and section, so a push soak does not overwrite the pull one.
    pull = args.mode == "pull"
    suffix, label = ("", "") if pull else (f"_{args.mode}", f" ({args.mode})")
    title = f"Soak{label}: {args.requests} short requests through pdserve up"
    publish(res, args.out or f"docs/results/soak{suffix}.json", f"soak{suffix}", title, markdown(res, args))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
