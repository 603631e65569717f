"""Per-request placement against static setups and other systems' rules, at equal cores (2 nodes).

    python -m pdserve.benchmarks.placement [--mixed-rates 0.25 0.5 0.75] [--multiturn-rates 0.1 0.2]
                                          [--seconds-per-rate 45] [--profile FILE]

Six setups, each started with `pdserve up` (one core per node):
  colo       colocated x2, round robin (the static colocated setup, and multiturn's round robin)
  pull       1P1D pull (the static PD setup)
  auto       1P1D, --mode auto: pdserve's cost-based choice of local or remote prefill
  auto2      2 kv_both nodes, --mode auto: each request prefilled where it decodes, or on the other
             node and pulled (before session 28: 2 colocated nodes, no remote choice)
  threshold  1P1D, --mode auto --placement threshold (Dynamo's rule)
  scorers    1P1D, --mode auto --placement scorers (llm-d's weighted scorers)
on two workloads of `pdserve bench`: `mixed` (90 % 128->128, 10 % 2048->64) and `multiturn`
(conversations of 4 turns on a shared 512-token system prompt, 64-token turns and answers, 1 s
think time; the rate is of conversations). SLOs are the study's (benchmarks/study.py). The profile
the proxy prices placements with is measured first (`pdserve profile --quick`, one thread like
each node) unless --profile names one.

Targets (issue 16): on mixed, auto's goodput >= 1.0x the best static setup (colo, pull) at every
rate and >= 1.3x at one rate at least; on multiturn, auto's median TTFT <= 0.6x round robin's
(colo); placement <= 2 ms per request at the proxy (p99 of x-pdserve-placement-ms).

Writes docs/results/placement.json, placement.png and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from pdserve.benchmarks.report import publish
from pdserve.bench_serving import answer_tokenizer, run_benchmark
from pdserve.benchmarks.study import multiturn_workload, rate_workload, study_slos
from pdserve.config import EngineConfig
from pdserve.plan.profile import ProfilePoints, run_profile
from pdserve.platform import plan_kernels
from pdserve.procs import ProcessGroup, up_child
from pdserve.workload import goodput_items, mixed_dataset, summarize

SETUPS = {
    "colo": ("colocated x2, round robin", ["--colocated", "2", "--no-chunked-prefill"]),
    "pull": ("1P1D pull", ["--mode", "pull"]),
    "auto": ("1P1D auto (cost)", ["--mode", "auto"]),
    "auto2": ("2 kv_both, auto (cost)", ["--mode", "auto", "--nodes", "2", "--no-chunked-prefill"]),
    "threshold": ("1P1D auto, Dynamo's threshold rule", ["--mode", "auto", "--placement", "threshold"]),
    "scorers": ("1P1D auto, llm-d's scorers", ["--mode", "auto", "--placement", "scorers"]),
}
STATIC = ("colo", "pull")


def run_setup(key: str, profile: str, dtype: str, slos: dict, args) -> dict:
    label, up_args = SETUPS[key]
    extra = []
    if "auto" in up_args:  # the cost rule keeps requests within the study's SLOs first
        extra = ["--profile", profile, "--slo", *goodput_items(slos)]
    points: dict[str, list[dict]] = {"mixed": [], "multiturn": []}
    answer_ids = answer_tokenizer(None)  # multiturn puts each answer into the next turn's prompt
    with ProcessGroup(stop_grace_s=30) as group:
        up = group.start(up_child((*up_args, *extra, "--dtype", dtype)))
        group.wait_ready([up], 300)
        warm = mixed_dataset(4, seed=999, long_fraction=0.5)
        asyncio.run(run_benchmark(up.url, warm, "completions", None, float("inf"), 1.0, None, 0, show_progress=False))
        for dataset, rates in (("mixed", args.mixed_rates), ("multiturn", args.multiturn_rates)):
            for i, rate in enumerate(rates):
                if dataset == "mixed":
                    requests = rate_workload(i, rate, args.seconds_per_rate, args.min_prompts)
                else:
                    requests = multiturn_workload(i, rate, args.seconds_per_rate, args.min_conversations)
                print(f"[{key}] {label}: {dataset}, {len(requests)} requests at {rate} /s", flush=True)
                results, duration = asyncio.run(run_benchmark(up.url, requests, "completions", None, rate, 1.0,
                                                              None, seed=i, show_progress=False,
                                                              answer_ids=answer_ids))
                summary = summarize(results, duration, slos)
                summary["request_rate"] = rate
                placements = [r.stages_ms.get("placement") for r in results if "placement" in r.stages_ms]
                summary["placement_p99_ms"] = float(np.percentile(placements, 99)) if placements else None
                summary["remote_share"] = remote_share(results)
                points[dataset].append(summary)
                print(f"[{key}] {dataset} {rate}: attainment {summary['slo_attainment'] * 100:.0f} %, goodput "
                      f"{summary['request_goodput']:.2f} req/s, median TTFT {summary['median_ttft_ms']:.0f} ms, "
                      f"failed {summary['failed']}", flush=True)
    return {"label": label, "up_args": up_args, "points": points}


def remote_share(results) -> float | None:
    """Share of auto mode's requests prefilled on a P node (None when nothing was placed)."""
    placed = [r for r in results if r.placement]
    return sum(r.placement == "remote" for r in placed) / len(placed) if placed else None


def goodput_over_best_static(setups: dict, key: str) -> list[float | None]:
    """`key`'s mixed goodput per rate over the better of the static setups at that rate."""
    ratios = []
    for i, point in enumerate(setups[key]["points"]["mixed"]):
        best = max(setups[k]["points"]["mixed"][i]["request_goodput"] for k in STATIC)
        ratios.append(point["request_goodput"] / best if best else None)
    return ratios


def median_ttft_over_round_robin(setups: dict, key: str, workload: str = "multiturn") -> list[float | None]:
    """`key`'s median TTFT per rate over round robin's (colo) at that rate."""
    base = [p["median_ttft_ms"] for p in setups["colo"]["points"][workload]]
    return [p["median_ttft_ms"] / b if b else None for p, b in zip(setups[key]["points"][workload], base)]


def targets(res: dict) -> dict:
    setups, out = res["setups"], {}
    if all(k in setups for k in STATIC):
        for key in ("auto", "auto2"):
            if key in setups:
                out[f"mixed_{key}_over_best_static"] = goodput_over_best_static(setups, key)
    if "colo" in setups:
        for k in ("auto", "auto2", "threshold", "scorers"):
            if k in setups:
                out[f"multiturn_{k}_median_ttft_over_round_robin"] = median_ttft_over_round_robin(setups, k)
    p99s = [p["placement_p99_ms"] for s in setups.values() for d in s["points"].values() for p in d
            if p.get("placement_p99_ms") is not None]
    out["placement_p99_ms_worst"] = max(p99s) if p99s else None
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for key, s in res["setups"].items():
        mixed = s["points"]["mixed"]
        axes[0].plot([p["request_rate"] for p in mixed], [p["request_goodput"] for p in mixed], marker="o",
                     label=f"{key}: {s['label']}")
        turns = s["points"]["multiturn"]
        axes[1].plot([p["request_rate"] for p in turns], [p["median_ttft_ms"] for p in turns], marker="o",
                     label=f"{key}: {s['label']}")
    axes[0].set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="mixed: goodput under the SLOs")
    axes[1].set(xlabel="conversation rate (/s)", ylabel="median TTFT (ms)", title="multiturn: median TTFT")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict, args) -> str:
    slos, t = res["slos_ms"], res["targets"]
    lines = [
        f"Command: `python -m pdserve.benchmarks.placement --mixed-rates {' '.join(f'{r:g}' for r in args.mixed_rates)} "
        f"--multiturn-rates {' '.join(f'{r:g}' for r in args.multiturn_rates)} --seconds-per-rate "
        f"{args.seconds_per_rate:g}` ({res['date']}, {res['dtype']}, this 2-core machine, one core per node; "
        f"profile: {res['profile']}). SLOs as in the study: TTFT {slos['ttft_ms']:.0f} ms, TPOT {slos['tpot_ms']:.1f} ms"
        + (f"; run again later with `--merge`: {', '.join(res['run_again'])}." if res.get("run_again") else "."),
        "",
        "| setup | workload | rate (/s) | done | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | attainment | "
        "goodput (req/s) | remote prefills | placement p99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in res["setups"].items():
        for dataset, points in s["points"].items():
            for p in points:
                share = "–" if p.get("remote_share") is None else f"{p['remote_share'] * 100:.0f} %"
                placing = "–" if p.get("placement_p99_ms") is None else f"{p['placement_p99_ms']:.2f}"
                lines.append(
                    f"| {key}: {s['label']} | {dataset} | {p['request_rate']:g} | {p['completed']}/"
                    f"{p['completed'] + p['failed']} | {p['median_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f} | "
                    f"{p['median_tpot_ms']:.1f} / {p['p99_tpot_ms']:.1f} | {p['slo_attainment'] * 100:.0f} % | "
                    f"{p['request_goodput']:.2f} | {share} | {placing} |")
    fmt = lambda xs: ", ".join("–" if x is None else f"{x:.2f}x" for x in xs)  # noqa: E731
    lines += ["", "Targets:", ""]
    if "mixed_auto_over_best_static" in t:
        lines.append(f"- mixed, auto's goodput over the best static setup per rate: "
                     f"{fmt(t['mixed_auto_over_best_static'])} (target >= 1.0x at every rate, >= 1.3x at one)"
                     + (f"; auto2: {fmt(t['mixed_auto2_over_best_static'])}" if "mixed_auto2_over_best_static" in t
                        else "") + ".")
    for k in ("auto", "auto2", "threshold", "scorers"):
        if f"multiturn_{k}_median_ttft_over_round_robin" in t:
            lines.append(f"- multiturn, {k}'s median TTFT over round robin's (colo) per rate: "
                         f"{fmt(t[f'multiturn_{k}_median_ttft_over_round_robin'])} (target for auto <= 0.6x).")
    if t.get("placement_p99_ms_worst") is not None:
        lines.append(f"- placement at the proxy: p99 {t['placement_p99_ms_worst']:.2f} ms at worst (target <= 2 ms).")
    lines += ["", "![placement](results/placement.png)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixed-rates", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--multiturn-rates", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--seconds-per-rate", type=float, default=45.0)
    parser.add_argument("--min-prompts", type=int, default=20)
    parser.add_argument("--min-conversations", type=int, default=6)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--profile", default=None, help="price placements with this profile (default: measure one)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="docs/results/placement.json")
    parser.add_argument("--merge", default=None, metavar="JSON",
                        help="run only --setups again, keeping the other setups, SLOs and profile of this earlier run")
    args = parser.parse_args()
    args.dtype = plan_kernels(args.dtype).dtype
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(Path(args.merge).read_text()) if args.merge else None
    profile = args.profile or (earlier["profile"] if earlier else None)
    if profile is None:  # measured alone on the machine, before any node starts
        profile = str(out.with_name("placement_profile.json"))
        run_profile(EngineConfig(dtype=args.dtype, threads=1), ProfilePoints.quick()).save(Path(profile))
    if earlier:
        idle, slos = earlier["idle"], earlier["slos_ms"]
    else:
        idle, slos = study_slos(args.dtype, 2.0, 1.5)
    print(f"idle latencies {idle}; SLOs {slos}", flush=True)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "profile": profile, "idle": idle,
                 "slos_ms": slos, "setups": dict(earlier["setups"]) if earlier else {},
                 "run_again": (earlier.get("run_again", []) if earlier else []) + (args.setups if earlier else [])}
    for key in args.setups:
        res["setups"][key] = run_setup(key, profile, args.dtype, slos, args)
    res["targets"] = targets(res)
    plot(res, out.with_name("placement.png"))
    publish(res, str(out), "placement", "Per-request placement vs static setups and other rules (issue 16)",
            markdown(res, args))


if __name__ == "__main__":
    main()
