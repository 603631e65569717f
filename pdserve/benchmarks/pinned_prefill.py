"""What slows a pinned node's prefill on a host it shares with serving.

    python -m pdserve.benchmarks.pinned_prefill [--prompts 30] [--streams 3]

`pdserve up` pins each node to a core of its own and lets the proxy (and a bench client) run
wherever the OS puts them. simcheck saw P's engine prefill a 128-token prompt 30-40 % slower at
1 req/s than at 0.5 while the profile's co-run factor (a twin engine on the other core) says the
engines do not slow each other. This separates the suspects: a `pdserve serve` node on the first
core prefills 128-token prompts one at a time (its engine's own time: x-pdserve-ttft-ms minus
x-pdserve-queue-ms), while the second core is
- idle;
- running a node that streams `--streams` answers to a client pinned beside it;
- running that node, its answers streamed through an unpinned proxy to an unpinned client (as
  `pdserve up` and simcheck run them);
- idle again (the host's drift over the run).

Writes docs/results/pinned_prefill.json and a section of docs/benchmarks.md. Needs two cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from pdserve.benchmarks.report import publish
from pdserve.plan.corun import RELAY_PROMPT, prefills, timed_beside
from pdserve.platform import CpuInfo
from pdserve.procs import Child, ProcessGroup

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=30, help="prefills per condition")
    parser.add_argument("--streams", type=int, default=3, help="answers the load streams at a time")
    parser.add_argument("--out", default="docs/results/pinned_prefill.json")
    args = parser.parse_args()
    if args.prompts < 2 or args.streams < 1:
        parser.error("--prompts needs at least 2 and --streams at least 1")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        parser.error(f"needs two cores; this process may use {len(cores)}")
    first, second = cores[0], cores[1]
    both = {first, second}
    logs = tempfile.TemporaryDirectory(prefix="pdserve-pinned-prefill-")
    with logs, ProcessGroup() as group:
        p = Child.on_free_port("p", ["serve", "--role", "both"], (first,), log_path=f"{logs.name}/p.log")
        d = Child.on_free_port("d", ["serve", "--role", "both"], (second,), log_path=f"{logs.name}/d.log")
        proxy = Child.on_free_port("proxy", ["proxy", "--mode", "colocated", "--node", d.url], tuple(both),
                                   log_path=f"{logs.name}/proxy.log")
        for child in (p, d):
            group.start(child)
        group.wait_ready([p, d], 300)
        group.start(proxy)
        group.wait_ready([proxy], 60)
        prefills(p.url, 5, 1)  # warm-up
        conditions = {
            "second core idle": timed_beside(p.url, args.prompts, 100),
            "a node on the second core streams to a client pinned beside it":
                timed_beside(p.url, args.prompts, 200, d.url, {second}, args.streams),
            "... through an unpinned proxy to an unpinned client":
                timed_beside(p.url, args.prompts, 300, proxy.url, both, args.streams),
            "second core idle again": timed_beside(p.url, args.prompts, 400),
        }
    cpu = CpuInfo.detect()
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu.model, "isa": cpu.isa, "prompt_tokens": RELAY_PROMPT,
               "streams": args.streams, "conditions": conditions}
    idle = conditions["second core idle"]["p50_ms"]
    rows = [f"| {name} | {c['load_tokens_per_s']:.0f} | {c['p10_ms']:.1f} | {c['p50_ms']:.1f} "
            f"({c['p50_ms'] / idle:.2f}x) | {c['p90_ms']:.1f} |" for name, c in conditions.items()]
    text = "\n".join([
        f"Command: `python -m pdserve.benchmarks.pinned_prefill --prompts {args.prompts} --streams {args.streams}` "
        f"({results['date']}, {cpu.model}, {cpu.isa}; `--dtype auto`). A `pdserve serve` node pinned to one core "
        f"prefills {RELAY_PROMPT}-token prompts one at a time; its engine's own time (x-pdserve-ttft-ms minus "
        "x-pdserve-queue-ms) while the second core does what the row says.", "",
        "| second core | load (tokens/s) | prefill p10 (ms) | p50 | p90 |", "|---|---|---|---|---|", *rows])
    publish(results, args.out, "pinned_prefill", "What slows a pinned node's prefill (pinned_prefill)", text)


if __name__ == "__main__":
    main()
