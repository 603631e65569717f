"""`pdserve up --ray` across hosts on one machine: two network namespaces on a bridge
(benchmarks/netns.py), a Ray head in one, a Ray worker in the other.

    sudo python -m pdserve.benchmarks.ray_hosts [--num-prompts 48] [--repeats 3]

1. Start-up: from the Ray cluster being up to a 1P1D cluster healthy (the proxy answering and both
   nodes healthy in its /v1/nodes), `--repeats` times (target: <= 20 s).
2. KV transfer between the namespaces over tcp, GB/s: the real connector code, P's process in one
   namespace and D's in the other (transfer.between_hosts), contiguous and scattered, and the
   raw link's throughput.
3. A bench run through 1P1D and 1P2D spread over the two hosts: random prompts (512 in, 64 out),
   all sent at once; throughput, TTFT and TPOT.

Needs root (namespaces). Writes docs/results/ray_hosts.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from pdserve.testing.netns import Host, Hosts, RayOnHosts, why_not
from pdserve.benchmarks.report import publish
from pdserve.benchmarks.transfer import between_hosts
from pdserve.bench_serving import run_benchmark
from pdserve.workload import random_dataset, summarize

PORT = 8000
NODE = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.5"]


def start_up(head: Host, ray_cluster: RayOnHosts, prefill: int, decode: int, log: str) -> subprocess.Popen:
    return head.popen([sys.executable, "-m", "pdserve.cli", "up", "--ray", ray_cluster.address, "--prefill",
                       str(prefill), "--decode", str(decode), "--ray-placement", "spread", "--host", head.address,
                       "--port", str(PORT), *NODE], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ray_cluster.env)


def wait_healthy(url: str, up: subprocess.Popen, nodes: int, log: str, timeout_s: float = 300) -> float:
    """Seconds until the proxy answers and lists `nodes` healthy nodes."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if up.poll() is not None:
            raise RuntimeError(f"pdserve up --ray exited: {open(log).read()[-3000:]}")
        try:
            listed = httpx.get(url + "/v1/nodes", timeout=2).json()["nodes"]
            if len(listed) == nodes and all(n["healthy"] for n in listed):
                return time.perf_counter() - start
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"not healthy in {timeout_s} s: {open(log).read()[-3000:]}")


def stop(up: subprocess.Popen) -> None:
    up.send_signal(signal.SIGINT)
    try:
        up.wait(60)
    except subprocess.TimeoutExpired:
        up.kill()


def bench(url: str, num_prompts: int) -> dict:
    requests = random_dataset(num_prompts, 512, 64, 0.0, seed=7)
    warm = random_dataset(4, 128, 8, 0.0, seed=8)
    asyncio.run(run_benchmark(url, warm, "completions", None, float("inf"), 1.0, None, 0, show_progress=False))
    results, duration = asyncio.run(run_benchmark(url, requests, "completions", None, float("inf"), 1.0, None, 0,
                                                  show_progress=False))
    s = summarize(results, duration, {})
    keys = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    return {k: s[k] for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--out", default="docs/results/ray_hosts.json")
    args = parser.parse_args()
    reason = why_not()
    if reason:
        sys.exit(f"ray_hosts: {reason}")
    res: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    log = tempfile.NamedTemporaryFile(prefix="pdserve-ray-up-", suffix=".log", delete=False).name
    with Hosts(2) as hosts, RayOnHosts(hosts, cpus=4) as ray_cluster:
        head, url = hosts[0], f"http://{hosts[0].address}:{PORT}"
        startups = []
        for _ in range(args.repeats):
            up = start_up(head, ray_cluster, 1, 1, log)
            try:
                startups.append(wait_healthy(url, up, 2, log))
            finally:
                stop(up)
        res["startup_s"] = startups
        res["transfer"] = between_hosts(hosts, args.mib, args.repeats, [], ("tcp",))["backends"]
        for prefill, decode in ((1, 1), (1, 2)):
            up = start_up(head, ray_cluster, prefill, decode, log)
            try:
                wait_healthy(url, up, prefill + decode, log)
                res[f"{prefill}P{decode}D"] = bench(url, args.num_prompts)
            finally:
                stop(up)
    t = res["transfer"]
    lines = [f"Command: `python -m pdserve.benchmarks.ray_hosts` ({res['date']}; as root; this machine, "
             f"{res['cpus']} CPUs, shared by both namespaces; SmolLM2-135M float32). Two network namespaces on a "
             "bridge, a Ray head in one and a Ray worker in the other (4 logical CPUs each); `pdserve up --ray "
             "--ray-placement spread` puts P on one host and D on the other.", "",
             f"- 1P1D healthy after the Ray cluster is up: median {statistics.median(startups):.1f} s "
             f"(runs: {', '.join(f'{s:.1f}' for s in startups)}; target <= 20 s).",
             f"- KV transfer between the namespaces, tcp ({t['bytes'] / 2**20:.0f} MiB, best of {args.repeats}): "
             f"contiguous {t['tcp_contiguous_gbps']:.2f} GB/s, scattered {t['tcp_scattered_gbps']:.2f} GB/s "
             f"(the raw link: {t['link_gbps']:.2f} GB/s; every transport: `transfer --hosts`).",
             "", f"Bench: {args.num_prompts} random prompts, 512 tokens in, 64 out, all sent at once.", "",
             "| setup | completed | req/s | output tok/s | median TTFT ms | p99 TTFT ms | median TPOT ms | p99 TPOT ms |",
             "|---|---|---|---|---|---|---|---|"]
    for key in ("1P1D", "1P2D"):
        b = res[key]
        lines.append(f"| {key} | {b['completed']}/{b['completed'] + b['failed']} | {b['request_throughput']:.2f} | "
                     f"{b['output_throughput']:.1f} | {b['median_ttft_ms']:.0f} | {b['p99_ttft_ms']:.0f} | "
                     f"{b['median_tpot_ms']:.1f} | {b['p99_tpot_ms']:.1f} |")
    lines += ["", "Both namespaces share this machine's CPUs: a second decode node adds decode capacity only as "
              "far as cores are free, and the network between the hosts is a veth pair and a bridge, not a NIC."]
    publish(res, args.out, "ray_hosts", "pdserve up --ray across hosts (issue 17)", "\n".join(lines))


if __name__ == "__main__":
    main()
