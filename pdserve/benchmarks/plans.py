"""The planner's answers at 8, 64 and 512 nodes on `mixed`, for a few SLOs, from one profile.

    python -m pdserve.benchmarks.plans [--profile docs/results/profile.json] [--scales 8 64 512]

For each scale N and SLO set, `pdserve plan --max-nodes N` at a rate of N x --rate-per-node: the
cheapest setup, and the smallest colocated and PD setups that meet the SLOs (goodput per node).
Writes docs/results/plans.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

from pdserve.benchmarks.report import publish
from pdserve.plan.planner import Planner
from pdserve.plan.profile import Profile
from pdserve.workload import mixed_dataset

# (name, SLOs): the study's (2 x idle long TTFT, 1.5 x idle decode step), and two looser ones.
SLO_SETS = {
    "study (TTFT 10.9 s, TPOT 36 ms)": {"ttft_ms": 10867.0, "tpot_ms": 36.3},
    "loose TPOT (TTFT 10.9 s, TPOT 60 ms)": {"ttft_ms": 10867.0, "tpot_ms": 60.0},
    "tight TTFT (TTFT 3 s, TPOT 60 ms)": {"ttft_ms": 3000.0, "tpot_ms": 60.0},
}


def best(rows: list[dict], pd: bool) -> dict | None:
    passing = [r for r in rows if r["meets"] and (r["family"].startswith(("pull", "push")) == pd)]
    return min(passing, key=lambda r: (r["nodes"], -r["slo_attainment"]), default=None)


def cell(row: dict | None) -> str:
    return f"{row['setup']} ({row['goodput_per_node']:.3f})" if row else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="docs/results/profile.json")
    parser.add_argument("--scales", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--rate-per-node", type=float, default=0.1)
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--out", default="docs/results/plans.json")
    args = parser.parse_args()
    profile = Profile.load(args.profile)
    requests = mixed_dataset(args.num_prompts, seed=0)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "profile": args.profile, "rate_per_node": args.rate_per_node,
                 "num_prompts": args.num_prompts, "answers": []}
    lines = [f"Command: `python -m pdserve.benchmarks.plans --scales {' '.join(map(str, args.scales))} "
             f"--rate-per-node {args.rate_per_node:g}` ({res['date']}, profile {args.profile}, `mixed`, "
             f"{args.num_prompts} requests per simulation, attainment 90 %). Cells: the smallest setup of the kind "
             "that meets the SLOs (goodput per node, req/s).", "",
             "| max nodes | rate (req/s) | SLOs | cheapest | colocated | PD | simulated requests | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for scale in args.scales:
        rate = scale * args.rate_per_node
        for name, slos in SLO_SETS.items():
            result = Planner(profile, requests, rate, slos, 0.9, scale, size_every_family=True).plan()
            res["answers"].append({"scale": scale, "rate": rate, "slos_name": name, **result})
            pick = result["pick"]
            lines.append(f"| {scale} | {rate:g} | {name} | {pick['setup'] if pick else 'none meets'} | "
                         f"{cell(best(result['setups'], False))} | {cell(best(result['setups'], True))} | "
                         f"{result['simulated_requests']:,} | {result['seconds']:.1f} |")
            print(lines[-1], flush=True)
    publish(res, args.out, "plans", "Planner answers at 8, 64 and 512 nodes (mixed)", "\n".join(lines))


if __name__ == "__main__":
    main()
