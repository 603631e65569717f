"""Node start-up time (weights already converted and cached) and idle RSS.

    python -m pdserve.benchmarks.startup [--runs 3] [--dtype auto]

Starts `pdserve serve` on a free loopback port, times process start -> first 200 from /health,
reads the idle process's RSS, stops it with SIGTERM. Writes `docs/results/startup.json` and a
section of `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.benchmarks.report import publish
from pdserve.models.locate import resolve_model_dir
from pdserve.plan.measure import one_start
from pdserve.platform import plan_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="auto: what this CPU runs fastest (see pdserve.platform)")
    parser.add_argument("--out", default="docs/results/startup.json")
    args = parser.parse_args()
    args.dtype = plan_kernels(args.dtype).dtype  # named in the report, passed to every node
    resolve_model_dir(None)  # make sure the converted weights are cached before timing
    runs = [one_start(args.dtype) for _ in range(args.runs)]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "dtype": args.dtype,
        "runs": runs,
        "startup_s_median": statistics.median(r["startup_s"] for r in runs),
        "idle_rss_mib_median": statistics.median(r["idle_rss_mib"] for r in runs),
    }
    body = (
        f"Command: `python -m pdserve.benchmarks.startup --runs {args.runs} --dtype {args.dtype}` ({result['date']}).\n\n"
        f"| | median | runs |\n|---|---|---|\n"
        f"| start-up to healthy, cached weights (s) | {result['startup_s_median']:.1f} | "
        + ", ".join(f"{r['startup_s']:.1f}" for r in runs) + " |\n"
        f"| idle RSS, default KV pool 0.5 GiB (MiB) | {result['idle_rss_mib_median']:.0f} | "
        + ", ".join(f"{r['idle_rss_mib']:.0f}" for r in runs) + " |"
    )
    publish(result, args.out, "startup", "Node start-up and idle memory", body)


if __name__ == "__main__":
    main()
