"""PD disaggregation vs colocated serving at equal cores: TTFT, TPOT and goodput over a rate sweep.

    python -m pdserve.benchmarks.study [--rates 0.25 0.5 0.75 1 1.5] [--seconds-per-rate 45]

Four setups, each started with `pdserve up` (one core per node, the same proxy in front), on the
`mixed` workload of `pdserve bench` (90 % 128->128 chat turns, 10 % 2048->64 documents):
  a  colocated: 2 `--role both` replicas, round robin, no chunked prefill;
  b  the same with chunked prefill (a 256-token budget per step, so long prompts share steps);
  c  1P1D pull;
  d  1P1D push.

SLOs come from one `--role both` node on one idle core, measured first:
  TTFT SLO = ttft_scale (2) x the idle TTFT of the workload's long prompt (2048 tokens): every
             request may wait for about one other long prefill;
  TPOT SLO = tpot_scale (1.5) x the idle decode step (TPOT of a lone 128-token request).
Goodput = requests per second that met both SLOs (DistServe's definition, vLLM's field names).

Writes docs/results/study.json, four PNGs next to it (goodput vs rate, TTFT CDF, TPOT CDF, a
per-request timeline of queue / prefill / transfer / decode) and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks import gap_views, host_load
from pdserve.benchmarks.report import publish
from pdserve.bench_serving import answer_tokenizer, run_benchmark
from pdserve.platform import plan_kernels
from pdserve.procs import Child, ProcessGroup, up_child
from pdserve.proxy.slo import meets
from pdserve.workload import (BenchRequest, mixed_dataset, multiturn_dataset, named_dataset, random_dataset,
                              summarize)

LONG_INPUT, LONG_OUTPUT, SHORT_INPUT, SHORT_OUTPUT = 2048, 64, 128, 128
CHUNK_BUDGET = 256
TURNS, SYSTEM_LEN, TURN_LEN, THINK_S = 4, 512, 64, 1.0  # `multiturn`'s conversations
WORKLOADS = ("mixed", "multiturn")


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    up_args: tuple[str, ...]
    simulated: str  # the same setup in `pdserve simulate --setup`
    budget: int | None = None  # --max-num-batched-tokens (None: the node's default)
    chunked: bool = True


SETUPS = {
    "a": Setup("a", "colocated x2", ("--colocated", "2", "--no-chunked-prefill"), "colocated:2", chunked=False),
    "b": Setup("b", "colocated x2 + chunked prefill", ("--colocated", "2", "--max-num-batched-tokens", str(CHUNK_BUDGET)),
               "colocated:2", budget=CHUNK_BUDGET),
    "c": Setup("c", "1P1D pull", ("--mode", "pull"), "pull:1P1D"),
    "d": Setup("d", "1P1D push", ("--mode", "push"), "push:1P1D"),
}


# -- SLOs from idle latencies --------------------------------------------------------------------


def idle_latencies(dtype: str, repeats: int = 3) -> dict:
    """Median idle TTFT (short and long prompt) and decode step of one node on one core."""
    node = Child.on_free_port("idle", ["serve", "--role", "both", "--threads", "1", "--dtype", dtype,
                                       "--log-level", "warning"], cores=(0,))
    with ProcessGroup() as group:
        group.launch([node], 300)
        probes = {"long": random_dataset(repeats + 1, LONG_INPUT, 2, 0.0, seed=7),
                  "short": random_dataset(repeats + 1, SHORT_INPUT, SHORT_OUTPUT, 0.0, seed=8)}
        out = {}
        for name, requests in probes.items():
            results = []
            for req in requests:  # one at a time: idle latencies (the first one warms up)
                results += asyncio.run(run_benchmark(node.url, [req], "completions", None, float("inf"), 1.0, None, 0,
                                                     show_progress=False))[0]
            results = results[1:]
            if not all(r.ok for r in results):
                raise RuntimeError(f"idle probe failed: {[r.error for r in results]}")
            out[f"ttft_{name}_ms"] = statistics.median(r.ttft_ms for r in results)
            if name == "short":
                out["decode_step_ms"] = statistics.median(r.tpot_ms for r in results)
        return out


# -- the sweep -----------------------------------------------------------------------------------


def study_slos(dtype: str, ttft_scale: float, tpot_scale: float) -> tuple[dict, dict[str, float]]:
    """(idle latencies, SLOs) as the module's docstring defines them."""
    idle = idle_latencies(dtype)
    return idle, {"ttft_ms": ttft_scale * idle["ttft_long_ms"], "tpot_ms": tpot_scale * idle["decode_step_ms"]}


def rate_workload(index: int, rate: float, seconds_per_rate: float, min_prompts: int) -> list[BenchRequest]:
    """The requests sent at the sweep's `index`-th rate (arrivals are seeded with `index`).
    A fresh seed per rate: the same prompts twice would hit the prefix cache."""
    n = max(min_prompts, round(rate * seconds_per_rate))
    return mixed_dataset(n, seed=1000 + index, long_fraction=0.1, short=(SHORT_INPUT, SHORT_OUTPUT),
                         long=(LONG_INPUT, LONG_OUTPUT))


def multiturn_workload(index: int, rate: float, seconds_per_rate: float, min_conversations: int) -> list[BenchRequest]:
    """Conversations for the `index`-th multiturn rate: a fresh seed (and system prompt) per rate."""
    n = max(min_conversations, round(rate * seconds_per_rate))
    return multiturn_dataset(n, seed=2000 + index, turns=TURNS, system_len=SYSTEM_LEN, user_len=TURN_LEN,
                             answer_len=TURN_LEN, think_s=THINK_S)


def sweep_workload(workload: str, index: int, rate: float, seconds_per_rate: float,
                   min_requests: int) -> list[BenchRequest]:
    """`mixed` (`chat`): requests at `rate`; `multiturn`: conversations at `rate`, at least
    `min_requests` turns; another of bench's named datasets (`summarize`, `generate`) at its shape."""
    if workload == "multiturn":
        return multiturn_workload(index, rate, seconds_per_rate, -(-min_requests // TURNS))
    if workload in ("mixed", "chat"):
        return rate_workload(index, rate, seconds_per_rate, min_requests)
    return named_dataset(workload, max(min_requests, round(rate * seconds_per_rate)), seed=3000 + index)


def run_setup(setup: Setup, rates: list[float], seconds_per_rate: float, min_prompts: int, dtype: str,
              slos: dict[str, float], workload: str = "mixed", extra_args: tuple[str, ...] = (),
              slo_sets: dict[str, dict[str, float]] | None = None) -> list[dict]:
    """One summary per rate; with `slo_sets`, also each set's goodput on the same requests
    (summary["goodput_by_slos"][name], requests per second)."""
    points = []
    answer_ids = answer_tokenizer(None) if workload == "multiturn" else None  # answers join the next prompt
    with ProcessGroup(stop_grace_s=30) as group:
        up = group.start(up_child((*setup.up_args, *extra_args, "--dtype", dtype)))
        group.wait_ready([up], 300)
        warm = mixed_dataset(4, seed=999, long_fraction=0.5)
        asyncio.run(run_benchmark(up.url, warm, "completions", None, float("inf"), 1.0, None, 0, show_progress=False))
        for i, rate in enumerate(rates):
            requests = sweep_workload(workload, i, rate, seconds_per_rate, min_prompts)
            print(f"[{setup.key}] {setup.label}: {workload}, {len(requests)} requests at {rate} /s", flush=True)
            pages = gap_views.Pages.fetch(up.url)
            gaps_before, load_before = gap_views.read(pages), host_load.read(up.proc.pid, pages)
            results, duration = asyncio.run(run_benchmark(up.url, requests, "completions", None, rate, 1.0, None,
                                                          seed=i, answer_ids=answer_ids))
            summary = summarize(results, duration, slos)
            pages = gap_views.Pages.fetch(up.url)
            summary["host_load"] = host_load.delta(load_before, host_load.read(up.proc.pid, pages))
            client_gaps = [r.max_itl_ms for r in results if r.ok and r.output_len > 1]
            summary["longest_gap_views"] = gap_views.shares(gaps_before, gap_views.read(pages), client_gaps)
            summary["goodput_by_slos"] = {name: sum(meets(r, s) for r in results) / duration
                                          for name, s in (slo_sets or {}).items()}
            summary["request_rate"] = rate
            summary["long"] = [r.input_len >= LONG_INPUT for r in results]
            points.append(summary)
            print(f"[{setup.key}] rate {rate}: attainment {summary['slo_attainment'] * 100:.0f} %, goodput "
                  f"{summary['request_goodput']:.2f} req/s, p99 TTFT {summary['p99_ttft_ms']:.0f} ms, "
                  f"p99 TPOT {summary['p99_tpot_ms']:.0f} ms, failed {summary['failed']}", flush=True)
            print(f"[{setup.key}] {gap_views.line(summary['longest_gap_views'])}", flush=True)
    return points


def knee_rate(points: list[dict], threshold: float = 0.9) -> int:
    """Index of the lowest rate from which attainment stays below the threshold (else the last
    rate): a single noisy low-rate point (20 requests) does not count as the fall."""
    knee = len(points) - 1
    for i in reversed(range(len(points))):
        if points[i]["slo_attainment"] >= threshold:
            break
        knee = i
    return knee


# -- plots ---------------------------------------------------------------------------------------


def plot_all(res: dict, outdir: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    setups, rates = res["setups"], res["rates"]
    knee = res["knee_index"]
    files = {}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, s in setups.items():
        axes[0].plot(rates, [p["request_goodput"] for p in s["points"]], marker="o", label=f"({key}) {s['label']}")
        axes[1].plot(rates, [p["slo_attainment"] * 100 for p in s["points"]], marker="o", label=f"({key}) {s['label']}")
    axes[0].plot(rates, rates, ls=":", color="gray", label="offered rate")
    axes[0].set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="Goodput under the SLO pair")
    axes[1].axhline(90, ls=":", color="gray")
    axes[1].set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", title="SLO attainment")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    files["goodput"] = str(outdir / "study_goodput.png")
    fig.savefig(files["goodput"], dpi=110)
    plt.close(fig)

    for metric, slo_key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, s in setups.items():
            p = s["points"][knee]
            ok = [e == "" for e in p["errors"]]
            if metric == "ttft":
                values = [t * 1e3 for t, good in zip(p["ttfts"], ok) if good]
            else:
                values = [(e2e * 1e3 - t * 1e3) / (n - 1) for t, e2e, n, good in
                          zip(p["ttfts"], p["e2els"], p["output_lens"], ok) if good and n > 1]
            values.sort()
            ax.plot(values, np.arange(1, len(values) + 1) / max(len(values), 1), drawstyle="steps-post",
                    label=f"({key}) {s['label']}")
        ax.axvline(res["slos_ms"][slo_key], ls=":", color="gray", label="SLO")
        ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of requests",
               title=f"{metric.upper()} CDF at {rates[knee]} req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        files[f"{metric}_cdf"] = str(outdir / f"study_{metric}_cdf.png")
        fig.savefig(files[f"{metric}_cdf"], dpi=110)
        plt.close(fig)

    # Per-request timeline: the first requests of the knee-rate run, one panel per setup.
    colors = {"queue": "#bbbbbb", "prefill": "#4c72b0", "transfer": "#dd8452", "decode": "#55a868"}
    fig, axes = plt.subplots(len(setups), 1, figsize=(11, 2.2 * len(setups)), sharex=True, squeeze=False)
    for ax, (key, s) in zip(axes[:, 0], setups.items()):
        p = s["points"][knee]
        for row, i in enumerate(range(min(12, len(p["start_times"])))):
            if p["errors"][i]:
                continue
            t = p["start_times"][i]
            st = p["stages_ms"][i]
            segments = [("queue", st.get("queue", 0) / 1e3), ("prefill", st.get("prefill", 0) / 1e3),
                        ("transfer", st.get("kv-load", 0) / 1e3)]
            for name, width in segments:
                ax.barh(row, width, left=t, color=colors[name], height=0.7)
                t += width
            first_token = p["start_times"][i] + p["ttfts"][i]
            ax.barh(row, p["start_times"][i] + p["e2els"][i] - first_token, left=first_token, color=colors["decode"],
                    height=0.7)
            if p["long"][i]:
                ax.text(p["start_times"][i], row, "2048 ", ha="right", va="center", fontsize=7)
        ax.set_ylabel(f"({key})")
        ax.set_title(s["label"], fontsize=9, loc="left")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel(f"seconds since the run began ({rates[knee]} req/s)")
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in colors.items()]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    files["timeline"] = str(outdir / "study_timeline.png")
    fig.savefig(files["timeline"], dpi=110)
    plt.close(fig)
    return files


# -- report --------------------------------------------------------------------------------------


def targets(res: dict) -> dict:
    setups, knee = res["setups"], res["knee_index"]
    out: dict = {"knee_rate": res["rates"][knee]}
    for pd in ("c", "d"):
        if pd not in setups:
            continue
        g = setups[pd]["points"][knee]["request_goodput"]
        for base in ("a", "b"):
            if base in setups:
                gb = setups[base]["points"][knee]["request_goodput"]
                out[f"goodput_{pd}_over_{base}"] = g / gb if gb else None
        out[f"p99_tpot_{pd}_over_idle_step"] = [p["p99_tpot_ms"] / res["idle"]["decode_step_ms"]
                                                for p in setups[pd]["points"]]
    return out


def markdown(res: dict, args, files: dict[str, str]) -> str:
    idle, slos, t = res["idle"], res["slos_ms"], res["targets"]
    seconds = res.get("seconds_per_rate", args.seconds_per_rate)  # older JSON did not record it
    lines = [
        f"Command: `python -m pdserve.benchmarks.study --rates {' '.join(f'{r:g}' for r in res['rates'])} "
        f"--seconds-per-rate {seconds:g}` ({time.strftime('%Y-%m-%d')}, {args.dtype}, this 2-core "
        "machine, one core per node, the client and proxy unpinned).",
        "",
        f"Workload: `mixed`, 90 % {SHORT_INPUT}->{SHORT_OUTPUT} and 10 % {LONG_INPUT}->{LONG_OUTPUT} random-token "
        f"prompts, Poisson arrivals, max(20, rate x {seconds:g} s) requests per rate, a fresh seed per "
        "rate (no prefix-cache hits), the same prompts for every setup.",
        "",
        f"SLO rule: one `--role both` node on one idle core gives TTFT {idle['ttft_long_ms']:.0f} ms for a "
        f"{LONG_INPUT}-token prompt ({idle['ttft_short_ms']:.0f} ms for {SHORT_INPUT}) and a decode step of "
        f"{idle['decode_step_ms']:.1f} ms. TTFT SLO = {slos['ttft_ms'] / idle['ttft_long_ms']:g} x {idle['ttft_long_ms']:.0f} = "
        f"**{slos['ttft_ms']:.0f} ms**; TPOT SLO = {slos['tpot_ms'] / idle['decode_step_ms']:g} x {idle['decode_step_ms']:.1f} = "
        f"**{slos['tpot_ms']:.1f} ms**. Goodput = requests per second that met both.",
        "",
        "| setup | rate (req/s) | done | throughput (req/s) | output (tok/s) | TTFT p50 / p99 (ms) | "
        "TPOT p50 / p99 (ms) | SLO attainment | goodput (req/s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in res["setups"].items():
        for p in s["points"]:
            lines.append(
                f"| ({key}) {s['label']} | {p['request_rate']:g} | {p['completed']}/{p['completed'] + p['failed']} | "
                f"{p['request_throughput']:.2f} | {p['output_throughput']:.1f} | {p['median_ttft_ms']:.0f} / "
                f"{p['p99_ttft_ms']:.0f} | {p['median_tpot_ms']:.1f} / {p['p99_tpot_ms']:.1f} | "
                f"{p['slo_attainment'] * 100:.0f} % | {p['request_goodput']:.2f} |")
    fmt = lambda x: "–" if x is None else f"{x:.2f}x"  # noqa: E731
    lines += ["", f"Targets, at {t['knee_rate']:g} req/s (the lowest rate from which (a) stays below 90 % "
              "attainment, or the highest rate if it never falls):", ""]
    for pd in ("c", "d"):
        if f"p99_tpot_{pd}_over_idle_step" in t:
            ratios = ", ".join(f"{r:.2f}x" for r in t[f"p99_tpot_{pd}_over_idle_step"])
            lines.append(f"- ({pd}) goodput {fmt(t.get(f'goodput_{pd}_over_a'))} of (a) (target >= 2x), "
                         f"{fmt(t.get(f'goodput_{pd}_over_b'))} of (b) (target >= 1.3x); p99 TPOT / idle decode step "
                         f"per rate: {ratios} (target <= 1.5x).")
    lines += ["", "Plots (at the rate above for the CDFs and the timeline):", ""]
    for name, path in files.items():
        lines.append(f"![{name}](results/{Path(path).name})")
    lines += ["", "Per-request figures (TTFT, ITL, stages) for every run: docs/results/study.json."]
    return "\n".join(lines)


def add_sweep_args(parser: argparse.ArgumentParser, rates: list[float], seconds_per_rate: float,
                   min_prompts: int, setups: dict[str, Setup] = SETUPS) -> None:
    """The sweep's flags (the study's and simcheck's): rates, requests per rate, setups, SLO scales, dtype."""
    parser.add_argument("--rates", type=float, nargs="+", default=rates)
    parser.add_argument("--seconds-per-rate", type=float, default=seconds_per_rate)
    parser.add_argument("--min-prompts", type=int, default=min_prompts, help="requests per rate at least")
    parser.add_argument("--setups", nargs="+", default=list(setups), choices=list(setups))
    parser.add_argument("--ttft-scale", type=float, default=2.0)
    parser.add_argument("--tpot-scale", type=float, default=1.5)
    parser.add_argument("--dtype", default="auto", help="auto: what this CPU runs fastest (see pdserve.platform)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser, [0.25, 0.5, 0.75, 1.0, 1.5], 45.0, 20)
    parser.add_argument("--out", default="docs/results/study.json")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="redo the plots and the report from an earlier run's JSON instead of measuring")
    args = parser.parse_args()
    args.dtype = plan_kernels(args.dtype).dtype  # named in the report, passed to every node
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        finish(res, args)
        return

    idle, slos = study_slos(args.dtype, args.ttft_scale, args.tpot_scale)
    print(f"idle latencies {idle}; SLOs {slos}", flush=True)
    res: dict = {"idle": idle, "slos_ms": slos, "rates": args.rates, "seconds_per_rate": args.seconds_per_rate,
                 "setups": {}}
    for key in args.setups:
        setup = SETUPS[key]
        res["setups"][key] = {"label": setup.label, "up_args": list(setup.up_args),
                              "points": run_setup(setup, args.rates, args.seconds_per_rate, args.min_prompts,
                                                  args.dtype, slos)}
    finish(res, args)


def finish(res: dict, args) -> None:
    """Targets, plots, JSON and the docs section of a finished run."""
    first = res["setups"].get("a") or next(iter(res["setups"].values()))
    res["knee_index"] = knee_rate(first["points"])
    res["targets"] = targets(res)
    outdir = Path(args.out).parent
    outdir.mkdir(parents=True, exist_ok=True)
    files = plot_all(res, outdir)
    publish(res, args.out, "study", "PD vs colocated at equal cores: goodput, TTFT, TPOT (mixed workload)",
            markdown(res, args, files))


if __name__ == "__main__":
    main()
