"""What the request records and the live page cost (issue 40): the same soak-style load through
`pdserve up` (1P1D pull) with them (a page open on /dashboard/events) and without (--no-dashboard).

    python -m pdserve.benchmarks.dashboard [--requests 1200] [--rate 20] [--rounds 2]

Rounds alternate without / with, so that a drifting host weighs on both alike. Each reports the
achieved request rate, median and p99 latency, and the proxy's CPU seconds per request (from
/proc: the cost itself, which throughput at an offered rate below saturation hides). Then the
page's own aggregation: one tick (window percentiles over 50 req/s x 5 minutes, the nodes, the 60
newest records as JSON) timed in this process. Target: <= 2 % of throughput at 20 req/s.
Writes docs/results/dashboard_overhead.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

import httpx

from pdserve.bench_serving import run_benchmark
from pdserve.benchmarks.report import publish
from pdserve.benchmarks.soak import wait_idle
from pdserve.platform import CpuInfo, plan_kernels
from pdserve.procinfo import children
from pdserve.procs import ProcessGroup, up_child
from pdserve.workload import random_dataset


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def proxy_pid(up_pid: int) -> int:
    for pid in children(up_pid):
        if "proxy" in open(f"/proc/{pid}/cmdline").read().split("\0"):
            return pid
    raise RuntimeError("pdserve up started no proxy")


def watch_page(url: str, stop: threading.Event, seen: list[int]) -> None:
    """A browser's share of the work: the page's feed, read to the end of every snapshot."""
    with httpx.stream("GET", url + "/dashboard/events", timeout=None) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.append(len(line))
            if stop.is_set():
                return


def one_round(args, with_dashboard: bool, seed: int) -> dict:
    flags = ("--mode", "pull", "--dtype", args.dtype, *(() if with_dashboard else ("--no-dashboard",)))
    with ProcessGroup(stop_grace_s=30) as group:
        up = group.start(up_child(flags))
        group.wait_ready([up], 300)
        warm = random_dataset(args.warmup, 32, 4, 0.5, seed=1)
        asyncio.run(run_benchmark(up.url, warm, "completions", None, args.rate, 1.0, None, 1, show_progress=False))
        wait_idle(up.url)
        stop, snapshots = threading.Event(), []
        page = threading.Thread(target=watch_page, args=(up.url, stop, snapshots), daemon=True)
        if with_dashboard:
            page.start()
        proxy = proxy_pid(up.proc.pid)
        cpu_before = cpu_seconds(proxy)
        requests = random_dataset(args.requests, 32, 4, 0.5, seed=seed)
        results, duration = asyncio.run(run_benchmark(up.url, requests, "completions", None, args.rate, 1.0, None,
                                                      seed, show_progress=False))
        cpu = cpu_seconds(proxy) - cpu_before
        stop.set()
    done = sorted(r.e2el_ms for r in results if r.ok)
    return {"dashboard": with_dashboard, "requests": len(results), "errors": len(results) - len(done),
            "duration_s": duration, "achieved_rps": len(done) / duration,
            "median_e2el_ms": done[len(done) // 2], "p99_e2el_ms": done[int(len(done) * 0.99) - 1],
            "proxy_cpu_ms_per_request": cpu / len(results) * 1e3,
            "page_snapshots": len(snapshots), "page_snapshot_kib": statistics.mean(snapshots) / 1024 if snapshots else 0}


def tick_cost(rate: float = 50.0, ticks: int = 20) -> dict:
    """The page's aggregation at `rate` req/s: a full window and ring of finished records."""
    from pdserve.proxy.dashboard import Dashboard
    from pdserve.proxy.membership import Membership
    from pdserve.proxy.records import WINDOW_S, RecentRequests, record_of
    from pdserve.proxy.timing import RequestTiming

    recent = RecentRequests({"ttft_ms": 2000.0, "tpot_ms": 100.0})
    members = Membership("pull", ("prefill", "decode"))
    members.add("http://127.0.0.1:1", "prefill")
    members.add("http://127.0.0.1:2", "decode")
    now, made = time.monotonic(), time.perf_counter()
    for i in range(int(rate * WINDOW_S)):
        t = RequestTiming(arrival=100.0, prefill_node="http://127.0.0.1:1", decode_node="http://127.0.0.1:2",
                          node_queue_s=0.01, prefill_done=100.2, decode_sent=100.21, transfer_s=0.01,
                          first_byte=100.3 + (i % 7) * 0.01, last_byte=101.0, done=101.0, output_chunks=30,
                          kv_tokens=300, kv_bytes=1 << 22, kv_transport="tcp")
        recent.finish(record_of(f"r{i}", "/v1/completions", "pull", True, t, "ok", 200),
                      now=now - WINDOW_S + i / rate, gaps=[0.02 + (i % 5) * 0.005] * 29)
    per_request = (time.perf_counter() - made) / int(rate * WINDOW_S)  # a record made and filed, its gaps counted
    dashboard = Dashboard("pull", members, recent)
    start = time.perf_counter()
    for _ in range(ticks):
        dashboard.tick()  # (as with a page open: the snapshot and its one encoding)
    seconds = (time.perf_counter() - start) / ticks
    return {"rate": rate, "window_records": len(recent._window), "ring_records": len(recent.finished),
            "tick_ms": seconds * 1e3, "snapshot_kib": len(dashboard.event) / 1024, "share_of_a_core": seconds,
            "record_us_per_request": per_request * 1e6}


def markdown(res: dict, args) -> str:
    lines = [f"Command: `python -m pdserve.benchmarks.dashboard --requests {args.requests} --rate {args.rate:g} "
             f"--rounds {args.rounds}` ({time.strftime('%Y-%m-%d')}, {res['cpu']}, {args.dtype}; `pdserve up` 1P1D "
             "pull; 16-48 prompt tokens, 2-6 output tokens, Poisson arrivals; with: a client reads the page's "
             "feed throughout).", "",
             "| round | dashboard | achieved req/s | median e2e ms | p99 e2e ms | proxy CPU ms / request | errors |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(res["rounds"]):
        lines.append(f"| {i // 2 + 1} | {'with' if r['dashboard'] else 'without'} | {r['achieved_rps']:.2f} | "
                     f"{r['median_e2el_ms']:.0f} | {r['p99_e2el_ms']:.0f} | {r['proxy_cpu_ms_per_request']:.2f} | "
                     f"{r['errors']} |")
    s, t = res["summary"], res["tick"]
    lines += ["", f"With / without, means of the rounds: throughput **{s['throughput_ratio']:.3f}x**, proxy CPU per "
                  f"request **{s['proxy_cpu_ratio']:.2f}x** ({s['proxy_cpu_ms_added']:+.2f} ms), median latency "
                  f"{s['median_ratio']:.3f}x. Target (throughput within 2 %): "
                  f"**{'met' if s['throughput_ratio'] >= 0.98 else 'not met'}**. A request's record, made and "
                  f"filed with its 29 gaps, costs the proxy **{t['record_us_per_request']:.0f} us** (timed in this "
                  f"process): {t['record_us_per_request'] / 1e3 / statistics.mean(r['proxy_cpu_ms_per_request'] for r in res['rounds']) * 100:.2f} % "
                  "of the proxy's CPU per request above.",
              "", f"The page's aggregation at {t['rate']:g} req/s ({t['window_records']} requests in the 5-minute "
                  f"window, {t['ring_records']} records kept): **{t['tick_ms']:.1f} ms a tick**, once a second "
                  f"whoever watches ({t['share_of_a_core'] * 100:.1f} % of a core); a snapshot is "
                  f"{t['snapshot_kib']:.0f} KiB."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    parser.add_argument("--rounds", type=int, default=2, help="without / with pairs")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="docs/results/dashboard_overhead.json")
    args = parser.parse_args()
    if args.requests < 1 or args.rate <= 0 or args.rounds < 1:
        parser.error("--requests and --rounds must be >= 1 and --rate > 0")
    args.dtype = plan_kernels(args.dtype).dtype
    rounds = [one_round(args, with_dashboard, seed=2 + i) for i in range(args.rounds) for with_dashboard in (False, True)]
    mean = lambda key, on: statistics.mean(r[key] for r in rounds if r["dashboard"] == on)  # noqa: E731
    summary = {"throughput_ratio": mean("achieved_rps", True) / mean("achieved_rps", False),
               "proxy_cpu_ratio": mean("proxy_cpu_ms_per_request", True) / mean("proxy_cpu_ms_per_request", False),
               "proxy_cpu_ms_added": mean("proxy_cpu_ms_per_request", True) - mean("proxy_cpu_ms_per_request", False),
               "median_ratio": mean("median_e2el_ms", True) / mean("median_e2el_ms", False)}
    cpu = CpuInfo.detect()
    amx = "AMX" if "amx_bf16" in cpu.flags else "no AMX"
    res = {"cpu": f"{cpu.model}, {cpu.isa}, native bf16: {cpu.native_bf16}, {amx}", "dtype": args.dtype, "rate": args.rate, "rounds": rounds, "summary": summary,
           "tick": tick_cost()}
    publish(res, args.out, "dashboard_overhead", "What the dashboard costs (issue 40)", markdown(res, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
