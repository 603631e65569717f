"""The placement study's setups in the simulator, at more nodes than this machine has.

    python -m pdserve.benchmarks.placement_sim [--nodes 2 8 64] [--seconds-per-rate 300]

Each setup of benchmarks/placement.py, grown to N nodes at the same shape, on the same workloads,
SLOs and profile (docs/results/placement.json, placement_profile.json), at the same rates per
node (the study's rate x N / 2):
  colo       colocated:N, round robin, no chunked prefill
  pull       pull:(N/2)P(N/2)D, round robin
  auto       auto:(N/2)P(N/2)D, the proxy's cost rule with the SLOs
  auto2      auto:N (N kv_both nodes placed per request; before session 28 colocated ones), no
             chunked prefill
  threshold  auto:(N/2)P(N/2)D, Dynamo's threshold rule
  scorers    auto:(N/2)P(N/2)D, llm-d's scorers
The auto setups run the proxy's own Placer (pdserve/proxy/placement.py) on the simulation's clock;
every node models the prefix cache (plan/sim/). Workloads: `mixed`, `multiturn` (the
study's: 4 turns, 512-token system prompt, 64-token turns and answers, 1 s think time) and
`multiturn-long` (8 turns, 1024-token system prompt, 128-token turns, at half the rates): histories
that grow longer.
N = 2 is there to set the simulator beside the measured study.

Writes docs/results/placement_sim.json, placement_sim.png and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdserve.benchmarks.placement import goodput_over_best_static, median_ttft_over_round_robin
from pdserve.benchmarks.report import publish
from pdserve.benchmarks.study import rate_workload
from pdserve.plan.profile import Profile
from pdserve.plan.sim import Setup, simulate
from pdserve.workload import BenchRequest, multiturn_dataset

SETUPS = {  # key: (label, setup at N nodes, placement rule, chunked prefill)
    "colo": ("colocated, round robin", lambda n: f"colocated:{n}", None, False),
    "pull": ("P:D 1:1 pull", lambda n: f"pull:{n // 2}P{n // 2}D", None, True),
    "auto": ("P:D 1:1 auto (cost)", lambda n: f"auto:{n // 2}P{n // 2}D", "cost", True),
    "auto2": ("colocated, auto (cost)", lambda n: f"auto:{n}", "cost", False),
    "threshold": ("P:D 1:1 auto, Dynamo's threshold", lambda n: f"auto:{n // 2}P{n // 2}D", "threshold", True),
    "scorers": ("P:D 1:1 auto, llm-d's scorers", lambda n: f"auto:{n // 2}P{n // 2}D", "scorers", True),
}
WORKLOADS = {  # name: (turns, system prompt, turn and answer tokens); None: mixed
    "mixed": None,
    "multiturn": (4, 512, 64),
    "multiturn-long": (8, 1024, 128),
}
RATE_SCALE = {"multiturn-long": 0.5}  # its conversations hold 4x the tokens: half the study's rates
THINK_S = 1.0


def workload(name: str, index: int, rate: float, seconds: float) -> list[BenchRequest]:
    if WORKLOADS[name] is None:
        return rate_workload(index, rate, seconds, 20)
    turns, system, turn = WORKLOADS[name]
    return multiturn_dataset(max(6, round(rate * seconds)), seed=2000 + index, turns=turns, system_len=system,
                             user_len=turn, answer_len=turn, think_s=THINK_S)


def run(profile: Profile, nodes: int, slos: dict, study: dict, seconds: float) -> dict:
    """Every setup on every workload at `nodes` nodes, at the study's rates x nodes / 2."""
    out: dict = {}
    for key, (label, shape, rule, chunked) in SETUPS.items():
        setup = Setup.parse(shape(nodes))
        points: dict[str, list[dict]] = {}
        for name in WORKLOADS:
            base_rates = study["mixed_rates"] if WORKLOADS[name] is None else study["multiturn_rates"]
            points[name] = []
            for i, base in enumerate(base_rates):
                rate = base * nodes / 2 * RATE_SCALE.get(name, 1.0)
                started = time.perf_counter()
                summary = simulate(profile, setup, workload(name, i, rate, seconds), rate, 1.0, i, slos,
                                   chunked_prefill=chunked, itls=False, prefix_caching=True,
                                   placement=rule or "cost")
                points[name].append({k: summary.get(k) for k in (
                    "completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                    "slo_attainment", "request_goodput", "placement_counts", "preemptions")}
                    | {"request_rate": rate, "simulated_s": time.perf_counter() - started})
                p = points[name][-1]
                print(f"[{nodes} nodes] {key} {name} {rate:g}/s: attainment {p['slo_attainment'] * 100:.0f} %, "
                      f"goodput {p['request_goodput']:.2f}, median TTFT {p['median_ttft_ms']:.0f} ms "
                      f"({p['simulated_s']:.1f} s)", flush=True)
        out[key] = {"label": label, "setup": shape(nodes), "points": points}
    return out


def targets(setups: dict) -> dict:
    """The study's targets, read on the simulated runs at one node count."""
    out: dict = {f"mixed_{key}_over_best_static": goodput_over_best_static(setups, key) for key in ("auto", "auto2")}
    for name in WORKLOADS:
        if WORKLOADS[name] is None:
            continue
        for key in ("auto", "auto2", "threshold", "scorers"):
            out[f"{name}_{key}_median_ttft_over_round_robin"] = median_ttft_over_round_robin(setups, key, name)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = list(res["nodes"])
    fig, axes = plt.subplots(len(counts), 3, figsize=(15, 3.6 * len(counts)), squeeze=False)
    for row, n in enumerate(counts):
        for col, name in enumerate(WORKLOADS):
            ax = axes[row][col]
            metric = "request_goodput" if WORKLOADS[name] is None else "median_ttft_ms"
            for key, s in res["nodes"][n]["setups"].items():
                pts = s["points"][name]
                ax.plot([p["request_rate"] for p in pts], [p[metric] for p in pts], marker="o", label=key)
            ax.set(title=f"{n} nodes, {name}", xlabel="rate (/s)",
                   ylabel="goodput (req/s)" if metric == "request_goodput" else "median TTFT (ms)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(res: dict, args) -> str:
    slos = res["slos_ms"]
    lines = [
        f"Command: `python -m pdserve.benchmarks.placement_sim --nodes {' '.join(map(str, args.nodes))} "
        f"--seconds-per-rate {args.seconds_per_rate:g}` ({res['date']}; simulated from {res['profile']}; SLOs of "
        f"the measured study: TTFT {slos['ttft_ms']:.0f} ms, TPOT {slos['tpot_ms']:.1f} ms; rates per node as "
        "measured, times N / 2). Goodput in req/s; attainment in %; median TTFT in ms.",
        "",
        "| nodes | setup | " + " | ".join(f"{name} @ rates" for name in WORKLOADS) + " |",
        "|---|---|" + "---|" * len(WORKLOADS),
    ]
    for n, block in res["nodes"].items():
        for key, s in block["setups"].items():
            cells = []
            for name in WORKLOADS:
                pts = s["points"][name]
                if WORKLOADS[name] is None:
                    cells.append(", ".join(f"{p['request_rate']:g}/s: {p['request_goodput']:.2f} "
                                           f"({p['slo_attainment'] * 100:.0f} %)" for p in pts))
                else:
                    cells.append(", ".join(f"{p['request_rate']:g}/s: {p['median_ttft_ms']:.0f} ms "
                                           f"({p['slo_attainment'] * 100:.0f} %)" for p in pts))
            lines.append(f"| {n} | {key}: {s['setup']} | " + " | ".join(cells) + " |")
    fmt = lambda xs: ", ".join("–" if x is None else f"{x:.2f}x" for x in xs)  # noqa: E731
    lines += ["", "Targets of issue 16, read on the simulated runs:", ""]
    for n, block in res["nodes"].items():
        t = block["targets"]
        lines.append(f"- {n} nodes: mixed goodput over the best static setup, auto {fmt(t['mixed_auto_over_best_static'])}"
                     f", auto2 {fmt(t['mixed_auto2_over_best_static'])}; median TTFT over round robin's, multiturn: "
                     f"auto {fmt(t['multiturn_auto_median_ttft_over_round_robin'])}, auto2 "
                     f"{fmt(t['multiturn_auto2_median_ttft_over_round_robin'])}; multiturn-long: auto "
                     f"{fmt(t['multiturn-long_auto_median_ttft_over_round_robin'])}, auto2 "
                     f"{fmt(t['multiturn-long_auto2_median_ttft_over_round_robin'])}.")
    lines += ["", "![placement, simulated](results/placement_sim.png)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--seconds-per-rate", type=float, default=300.0)
    parser.add_argument("--study", default="docs/results/placement.json",
                        help="the measured study whose SLOs and profile to use")
    parser.add_argument("--out", default="docs/results/placement_sim.json")
    args = parser.parse_args()
    if any(n < 2 or n % 2 for n in args.nodes):
        parser.error(f"--nodes: even counts of 2 or more (the P:D setups split them 1:1), got {args.nodes}")
    study = json.loads(Path(args.study).read_text())
    profile = Profile.load(study["profile"])
    rates = {"mixed_rates": sorted({p["request_rate"] for s in study["setups"].values() for p in s["points"]["mixed"]}),
             "multiturn_rates": sorted({p["request_rate"] for s in study["setups"].values()
                                        for p in s["points"]["multiturn"]})}
    res: dict = {"date": time.strftime("%Y-%m-%d"), "profile": study["profile"], "slos_ms": study["slos_ms"],
                 **rates, "nodes": {}}
    for n in args.nodes:
        setups = run(profile, n, study["slos_ms"], rates, args.seconds_per_rate)
        res["nodes"][n] = {"setups": setups, "targets": targets(setups)}
    out = Path(args.out)
    plot(res, out.with_name("placement_sim.png"))
    publish(res, str(out), "placement_sim", "Placement at 2, 8 and 64 nodes, simulated (issue 16)", markdown(res, args))


if __name__ == "__main__":
    main()
