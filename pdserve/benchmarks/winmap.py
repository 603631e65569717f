"""Where disaggregation pays: the win map, measured at 2 nodes and simulated at more.

    python -m pdserve.benchmarks.winmap [--workloads chat summarize generate] [--runs 2]
        [--setups a b c d e] [--min-prompts 40] [--seconds-per-rate 60] [--nodes 2 8 64]
    python -m pdserve.benchmarks.winmap --from-json docs/results/winmap.json   # map, plot and docs again
    python -m pdserve.benchmarks.winmap --add-to docs/results/winmap.json --setups e   # auto again, same SLOs
    python -m pdserve.benchmarks.winmap --from-json docs/results/winmap.json --nodes --auto-at-rate 2 8
        # auto simulated again with its shape picked at each cell's rate, the rest kept
    python -m pdserve.benchmarks.winmap --add-to docs/results/winmap.json --setups g --runs 1 --append  # one run more

Workloads are bench's named datasets (`chat` = mixed, `summarize` prefill-heavy, `generate`
decode-heavy), each at three rates (RATES; --rates-for NAME=R1,R2,R3). Every 2-node setup runs
for real with `pdserve up`, one core per node:
  a  colocated x2             b  colocated x2, chunked prefill (256-token steps)
  c  1P1D pull                d  1P1D push
  f  1P1D pull, D at most 8 streams (the planner's per-role pick for chat under an ITL SLO)
  g  colocated x2 whose prefill and decode take turns (--max-prefill-tokens-while-decoding 0: a
     prompt waits until the node's streams have finished, so no prefill lands in a stream's gap)
  e  auto at 2 nodes, with the run's profile, run once per SLO set with that set's SLOs and the
     workload's name: it runs as the shape of 2 nodes the simulator picks for them (plan/shape.py:
     2 kv_both nodes, or 1P1D; the map records which, `auto_shapes`), then places each request
     within it (over kv_both nodes: prefill where it decodes, or on the other node and pull; over
     1P1D: prefill on P, or on D itself). Its placement and the prefill cap an ITL SLO gives its
     nodes follow the SLOs the cell judges, as a deployment tuned to them would.
Each static run is judged against three SLO sets on the same requests: TTFT + TPOT, TTFT + ITL (a
request's longest gap between two tokens) and ITL alone; each auto run against its own. The SLOs come from one idle node, as the
study's: TTFT 2x its long-prompt TTFT, TPOT 1.5x and ITL ITL_SCALE x its decode step.

A cell (workload, SLO set, rate) names the setup of most goodput (mean over --runs runs), its
margin over the best setup of another kind (colocated: a, b, g; PD: c, d, f; auto: e), PD's best over
colocated's best and auto over the best static setup, with the runs' spread as the noise. The
simulated map (--nodes) prices the same cells at N nodes with the planner's families of each kind,
each as the whole N-node cluster at rate x N / 2 (the profile's costs); --auto-at-rate N prices
auto again at N nodes with its shape picked at each cell's rate, as `pdserve up --mode auto --rate`.

Writes docs/results/winmap.json (every run's summary), winmap.png (one heatmap per SLO set) and
the section `winmap` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from pdserve.benchmarks.report import publish
from pdserve.benchmarks.study import SETUPS as STUDY_SETUPS
from pdserve.benchmarks.study import Setup, run_setup, study_slos, sweep_workload
from pdserve.config import EngineConfig
from pdserve.plan.planner import Family, check_nodes, families
from pdserve.plan.profile import Profile, ProfilePoints, run_profile
from pdserve.plan.shape import shape_for, whole_cluster
from pdserve.plan.sim import simulate
from pdserve.platform import plan_kernels
from pdserve.workload import goodput_items

SETUPS = {**STUDY_SETUPS, "e": Setup("e", "auto at 2 nodes", ("--mode", "auto", "--nodes", "2"), "auto:2"),
          # the planner's per-role pick for chat under an ITL SLO on the shipped profile (`pdserve plan --nodes 2`)
          "f": Setup("f", "1P1D pull, D at most 8 streams", ("--mode", "pull", "--decode-max-num-seqs", "8"),
                     "pull:1P1D"),
          "g": Setup("g", "colocated x2, prefill and decode take turns",
                     ("--colocated", "2", "--max-prefill-tokens-while-decoding", "0"), "colocated:2")}
KINDS = {"a": "colocated", "b": "colocated", "c": "PD", "d": "PD", "e": "auto", "f": "PD", "g": "colocated"}
RATES = {"chat": [0.5, 0.75, 1.0], "summarize": [0.2, 0.35, 0.5], "generate": [0.15, 0.3, 0.45]}
ITL_SCALE = 4.0  # the ITL SLO over the idle decode step: room for one short prefill beside it


def slo_sets(slos: dict[str, float]) -> dict[str, dict[str, float]]:
    return {"ttft+tpot": {"ttft_ms": slos["ttft_ms"], "tpot_ms": slos["tpot_ms"]},
            "ttft+itl": {"ttft_ms": slos["ttft_ms"], "max_itl_ms": slos["max_itl_ms"]},
            "itl": {"max_itl_ms": slos["max_itl_ms"]}}


def best_by_kind(goodput: dict[str, float]) -> dict[str, float]:
    """Each kind's best goodput over its setups (setup key -> goodput), for the kinds present."""
    best: dict[str, float] = {}
    for key, g in goodput.items():
        best[KINDS[key]] = max(best.get(KINDS[key], g), g)
    return best


def cell(goodputs: dict[str, list[float]]) -> dict:
    """One cell from each setup's goodput per run: the winner, its margin over the best other kind,
    PD's best over colocated's best, auto over the best static setup, and the noise (the largest
    spread of one setup's runs, over its mean)."""
    mean = {k: statistics.mean(v) for k, v in goodputs.items()}
    best = max(mean, key=lambda k: mean[k])
    by_kind = best_by_kind(mean)
    others = [g for kind, g in by_kind.items() if kind != KINDS[best]]
    static = max((g for k, g in mean.items() if KINDS[k] != "auto"), default=None)

    def ratio(a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return None
        return a / b if b > 0 else (1.0 if a == 0 else float("inf"))

    noise = max(((max(v) - min(v)) / statistics.mean(v) for v in goodputs.values() if len(v) > 1 and statistics.mean(v)),
                default=0.0)
    return {"goodput": mean, "winner": best, "kind": KINDS[best],
            "margin": ratio(mean[best], max(others) if others else None),
            "pd_over_colocated": ratio(by_kind.get("PD"), by_kind.get("colocated")),
            "auto_over_static": ratio(by_kind.get("auto"), static), "noise": noise}


def run_key(setup: str, slo_set: str) -> str:
    """Where a setup's runs are kept: auto's once per SLO set (`e:ttft+itl`), a static one's once."""
    return f"{setup}:{slo_set}" if KINDS[setup] == "auto" else setup


def measured_map(res: dict) -> dict:
    """{workload: {slo set: [cell per rate]}} from the runs in `res`: each static setup's runs, and
    the auto runs tuned to that SLO set (an earlier map's single auto run, `e`, counts for every set)."""
    out = {}
    for workload, entry in res["workloads"].items():
        out[workload] = {}
        for name in res["slo_sets"]:
            judged = {key.partition(":")[0]: runs for key, runs in entry["setups"].items()
                      if key.partition(":")[2] in ("", name)}
            cells = []
            for i in range(len(entry["rates"])):
                goodputs = {key: [run[i]["goodput_by_slos"][name] for run in runs] for key, runs in judged.items()}
                cells.append(cell(goodputs))
            out[workload][name] = cells
    return out


def kind_families(profile: Profile, slos: dict[str, float], auto_shape: Family | None = None) -> dict[str, list[Family]]:
    """The planner's families by kind; auto's as it runs when its shape is `auto_shape`
    (plan/shape.py, cli.choose_auto_shape): over P and D nodes with every per-role setting the
    shape carries when that is PD, else over pairs of kv_both nodes batching as the shape does
    (chunked or not, its prefill cap: taking turns under TTFT + TPOT too)."""
    kinds: dict[str, list[Family]] = {"colocated": [], "PD": [], "auto": []}
    for family in families(profile, slos):
        kinds["auto" if family.mode == "auto" else "colocated" if family.mode == "colocated" else "PD"].append(family)
    if auto_shape is not None:
        kv_both = auto_shape.mode == "colocated"
        kinds["auto"] = [replace(auto_shape, mode="auto", decode=2 if kv_both else auto_shape.decode)]
    return kinds


def simulated_map(profile: Profile, res: dict, nodes: list[int], min_prompts: int) -> dict:
    """{N: {workload: {slo set: [{kind: (best family's setup, goodput)} per rate]}}}: each kind's
    best family at N nodes (units that divide N), the whole cluster simulated (plan/shape.py's
    whole_cluster) at the measured rate x N / 2; auto in the shape `pdserve up --mode auto --nodes
    N` picks for the workload and SLOs."""
    def cells(n: int, workload: str, slos: dict[str, float]) -> list[dict]:
        kinds = kind_families(profile, slos, shape_for(profile, workload, slos, n).family)
        fitting = {kind: [f for f in fams if n % f.unit_nodes == 0] for kind, fams in kinds.items()}
        priced = []
        for i in range(len(res["workloads"][workload]["rates"])):
            scaled, requests = cell_load(res, workload, i, n, min_prompts)
            priced.append({kind: best_priced(profile, fams, n, requests, scaled, slos)
                           for kind, fams in fitting.items() if fams})
        return priced

    return over_cells(res, nodes, cells)


def over_cells(res: dict, nodes: list[int], price) -> dict:
    """{N: {workload: {slo set: price(N, workload, slos)}}} over the map's workloads and SLO sets."""
    return {str(n): {workload: {name: price(n, workload, slos) for name, slos in res["slo_sets"].items()}
                     for workload in res["workloads"]} for n in nodes}


def at_nodes(rate: float, nodes: int) -> float:
    """A cell's rate (requests/s a node pair: the map measures pairs) offered to `nodes` nodes."""
    return rate * nodes / 2


def cell_load(res: dict, workload: str, index: int, nodes: int, min_prompts: int) -> tuple[float, list]:
    """A cell's load at `nodes` nodes: its rate there (at_nodes), and its requests."""
    scaled = at_nodes(res["workloads"][workload]["rates"][index], nodes)
    return scaled, sweep_workload(workload, index, scaled, res["seconds_per_rate"], min_prompts * nodes // 2)


def best_priced(profile: Profile, fams: list[Family], nodes: int, requests: list, rate: float,
                slos: dict[str, float]) -> tuple[str, float]:
    """The family of most simulated goodput as the whole `nodes`-node cluster: (its setup, goodput)."""
    tried = [(f.setup(nodes // f.unit_nodes), rate * simulate(
                profile, whole_cluster(f, nodes), requests, rate, 1.0, 0, slos, chunked_prefill=f.chunked,
                itls=False, prefill_cap=f.prefill_cap)["slo_attainment"]) for f in fams]
    return max(tried, key=lambda t: t[1])


def auto_at_rate_map(profile: Profile, res: dict, nodes: list[int], min_prompts: int) -> dict:
    """{N: {workload: {slo set: [(setup, goodput) per rate]}}}: auto as `pdserve up --mode auto
    --nodes N --rate R` runs it, its shape picked at the cell's own rate (R = rate x N / 2) instead
    of over fractions of what N idle nodes serve (plan/shape.py's RATE_FRACTIONS), which cannot
    know which side of a crossing between shapes the user's load falls on."""
    def told(n: int, workload: str, index: int, slos: dict[str, float]) -> tuple[str, float]:
        scaled, requests = cell_load(res, workload, index, n, min_prompts)
        shape = shape_for(profile, workload, slos, n, [scaled]).family
        return best_priced(profile, kind_families(profile, slos, shape)["auto"], n, requests, scaled, slos)

    return over_cells(res, nodes, lambda n, workload, slos: [
        told(n, workload, i, slos) for i in range(len(res["workloads"][workload]["rates"]))])


MIN_COMPARED = 0.01  # req/s: cells where neither auto nor the best static setup serves this are not compared
SERVABLE = 0.5  # a cell whose best setup meets the SLOs for this share of the requests offered is below saturation


def simulated_auto_over_static(res: dict, at_rate: bool = False) -> dict[str, dict]:
    """Per simulated node count, auto's goodput over the best static kind's (colocated or PD) in each
    cell: the worst cell (ratio, workload, SLO set, rate a node pair), how many fall under 0.99x, of
    how many compared; and the same over the servable cells alone, whose best setup meets the SLOs
    for SERVABLE of the requests or more (past saturation, which shape serves more turns with how
    long the burst lasts: docs/benchmarks.md, session 56). `at_rate`: auto with its shape picked at
    the cell's rate (auto_at_rate_map)."""
    out = {}
    for n, by_workload in res.get("simulated", {}).items():
        ratios, servable = [], []
        for workload, by_slo in by_workload.items():
            for name, cells in by_slo.items():
                autos = res.get("simulated_auto_at_rate", {}).get(n, {}).get(workload, {}).get(name)
                if at_rate and autos is None:
                    continue
                for i, c in enumerate(cells):
                    auto = autos[i][1] if at_rate else c["auto"][1]
                    static = max(g for kind, (_, g) in c.items() if kind != "auto")
                    if max(auto, static) < MIN_COMPARED:
                        continue
                    rate = res["workloads"][workload]["rates"][i]
                    ratio = (auto / static if static > 0 else float("inf"), workload, name, rate)
                    ratios.append(ratio)
                    if max(auto, static) >= SERVABLE * at_nodes(rate, int(n)):
                        servable.append(ratio)
        if ratios:
            out[n] = {**worst_of(ratios), "servable": worst_of(servable)}
    return out


def worst_of(ratios: list[tuple]) -> dict:
    return {"worst": min(ratios, default=None), "under": sum(r[0] < 0.99 for r in ratios), "cells": len(ratios)}


def planner_agreement(res: dict, nodes: str = "2", near: float = 0.05) -> dict:
    """How often the simulator's best kind at `nodes` (the planner's pick; every kind tied for best
    counts) is the measured cell's winning kind (`matched`), or measures within `near` of it (`near`),
    over the cells both maps hold."""
    cells = matched = close = 0
    for workload, by_slo in res.get("map", {}).items():
        for name, measured in by_slo.items():
            simulated = res.get("simulated", {}).get(nodes, {}).get(workload, {}).get(name, [])
            for c, sim in zip(measured, simulated):
                if not sim:
                    continue
                top = max(g for _, g in sim.values())
                picks = {kind for kind, (_, g) in sim.items() if g == top}
                by_kind = best_by_kind(c["goodput"])
                best = max(by_kind.values())
                cells += 1
                matched += c["kind"] in picks
                close += any(by_kind.get(kind, -1.0) >= best * (1 - near) for kind in picks)
    return {"cells": cells, "matched": matched, "near": close, "near_share": near}


def markdown(res: dict, png: str = "winmap.png") -> str:
    ran = {k for by_slo in res["map"].values() for cells in by_slo.values() for c in cells for k in c["goodput"]}
    columns = [k for k in SETUPS if k in ran]  # the setups this map ran
    lines = [f"Command: `python -m pdserve.benchmarks.winmap --workloads {' '.join(res['workloads'])} --runs "
             f"{res['runs']} --min-prompts {res['min_prompts']}` ({res['date']}, {res['cpu']}, {res['dtype']}). "
             f"SLOs from the idle node: TTFT {res['slos_ms']['ttft_ms']:.0f} ms, TPOT {res['slos_ms']['tpot_ms']:.1f} ms, "
             f"ITL (longest gap) {res['slos_ms']['max_itl_ms']:.0f} ms. Goodput in requests/s, mean of "
             f"{res['runs']} runs; noise = the largest spread of one setup's runs over its mean.", "",
             f"| workload | SLOs | rate | {' | '.join(columns)} | winner | margin | PD / colocated | "
             "auto / best static | noise |", "|---" * (len(columns) + 8) + "|"]
    fmt = lambda x: "–" if x is None else f"{x:.2f}x"  # noqa: E731
    for workload, by_slo in res["map"].items():
        rates = res["workloads"][workload]["rates"]
        for name, cells in by_slo.items():
            for rate, c in zip(rates, cells):
                g = " | ".join(f"{c['goodput'][k]:.2f}" if k in c["goodput"] else "–" for k in columns)
                lines.append(f"| {workload} | {name} | {rate:g} | {g} | ({c['winner']}) {c['kind']} | "
                             f"{fmt(c['margin'])} | {fmt(c['pd_over_colocated'])} | {fmt(c['auto_over_static'])} | "
                             f"{c['noise'] * 100:.0f} % |")
    lines += ["", "Setups: " + "; ".join(f"({k}) {SETUPS[k].label}" for k in columns) + ".", ""]
    shapes = [f"{workload}, {name}: {shape}" for workload, entry in res["workloads"].items()
              for name, shape in entry.get("auto_shapes", {}).items()]
    if shapes:
        lines += ["Auto (e) ran as: " + "; ".join(shapes) + ".", ""]
    for n, by_workload in res.get("simulated", {}).items():
        lines.append(f"Simulated at {n} nodes (each kind's best family; goodput req/s):")
        lines.append("")
        for workload, by_slo in by_workload.items():
            for name, cells in by_slo.items():
                row = "; ".join(", ".join(f"{kind} {setup} {g:.2f}" for kind, (setup, g) in c.items()) for c in cells)
                lines.append(f"- {workload}, {name}: {row}")
        lines.append("")
    for n, by_workload in res.get("simulated_auto_at_rate", {}).items():
        lines.append(f"Auto at {n} nodes told the rate (`--rate`: its shape picked at the cell's rate; "
                     "goodput req/s):")
        lines.append("")
        for workload, by_slo in by_workload.items():
            for name, cells in by_slo.items():
                lines.append(f"- {workload}, {name}: " + "; ".join(f"{setup} {g:.2f}" for setup, g in cells))
        lines.append("")
    lines += auto_over_static_lines(res)
    agree = planner_agreement(res)
    if agree["cells"]:
        lines += [f"The planner's pick at 2 nodes (the simulator's best kind) is the measured winner's kind in "
                  f"{agree['matched']} of {agree['cells']} cells, and measures within {agree['near_share']:.0%} "
                  f"of the winner in {agree['near']}.", ""]
    lines.append(f"![win map](results/{png})")
    return "\n".join(lines)


def auto_over_static_lines(res: dict) -> list[str]:
    """The simulated map's auto against the best static setup, per node count: as `--nodes N` picks
    its shape, and told the rate."""
    lines = []
    for at_rate, label in ((False, "its shape picked without the rate"), (True, "told the rate (`--rate`)")):
        summary = simulated_auto_over_static(res, at_rate)
        if summary:
            lines.append(f"Simulated auto / best static, {label} (servable: the cells whose best setup meets the "
                         f"SLOs for {SERVABLE:.0%} of the requests or more): " + "; ".join(
                             f"{n} nodes {worst_text(s)}, servable {worst_text(s['servable'])}"
                             for n, s in summary.items()) + ".")
            lines.append("")
    return lines


def worst_text(s: dict) -> str:
    if s["worst"] is None:
        return "none"
    ratio, workload, name, rate = s["worst"]
    return f"worst {ratio:.2f}x ({workload}, {name}, {rate:g} req/s a node pair), {s['under']} of {s['cells']} " \
           "under 0.99x"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"colocated": 0, "PD": 1, "auto": 2}
    names = list(res["slo_sets"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        workloads = list(res["map"])
        grid = [[colours[c["kind"]] for c in res["map"][w][name]] for w in workloads]
        ax.imshow(grid, cmap=matplotlib.colors.ListedColormap(["#9ecae1", "#fc9272", "#a1d99b"]), vmin=0, vmax=2)
        for y, w in enumerate(workloads):
            for x, c in enumerate(res["map"][w][name]):
                margin = "" if c["margin"] is None else f"\n{c['margin']:.2f}x"
                ax.text(x, y, f"{c['kind']}{margin}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(3), ["low", "mid", "high"])
        ax.set_yticks(range(len(workloads)), workloads)
        ax.set_title(f"SLOs: {name}")
    fig.suptitle("winner at 2 nodes (margin over the best other kind)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(res: dict, args) -> None:
    res["map"] = measured_map(res)
    if args.nodes or args.auto_at_rate:
        profile = Profile.load(args.profile or res["profile_path"])
    if args.nodes:
        res["simulated"] = simulated_map(profile, res, args.nodes, res["min_prompts"])
    if args.auto_at_rate:  # kept per node count: --nodes (empty) --auto-at-rate 64 adds 64 to an earlier run's
        res.setdefault("simulated_auto_at_rate", {}).update(
            auto_at_rate_map(profile, res, args.auto_at_rate, res["min_prompts"]))
    out = Path(args.out)
    plot(res, out.with_suffix(".png"))
    publish(res, str(out), "winmap", "Where disaggregation pays: the win map (2 nodes measured)",
            markdown(res, out.with_suffix(".png").name))


def parse_rates(items: list[str] | None) -> dict[str, list[float]]:
    rates = {k: list(v) for k, v in RATES.items()}
    for item in items or []:
        name, _, values = item.partition("=")
        try:
            rates[name] = [float(x) for x in values.split(",")]
        except ValueError:
            raise SystemExit(f"--rates-for {item!r}: expected NAME=R1,R2,R3") from None
    return rates


def fresh_map(args) -> dict:
    """A new map: the profile (measured alone, before any node starts, unless given) and the SLOs
    from one idle node."""
    args.dtype = plan_kernels(args.dtype).dtype
    profile_path = Path(args.profile or Path(args.out).with_name("winmap_profile.json"))
    if not args.profile:
        run_profile(EngineConfig(dtype=args.dtype, threads=1), ProfilePoints.full()).save(profile_path)
    idle, slos = study_slos(args.dtype, 2.0, 1.5)
    slos["max_itl_ms"] = ITL_SCALE * idle["decode_step_ms"]
    return {"date": time.strftime("%Y-%m-%d"), "cpu": Profile.load(profile_path).meta["cpu"], "dtype": args.dtype,
            "runs": args.runs, "min_prompts": args.min_prompts, "seconds_per_rate": args.seconds_per_rate,
            "idle": idle, "slos_ms": slos, "slo_sets": slo_sets(slos), "profile_path": str(profile_path),
            "setups": {}, "workloads": {}}


def earlier_map(path: str, args) -> dict:
    """An earlier map to run setups again in (--add-to): its profile, SLOs, rates and run lengths, so
    that the new runs are judged as its others were."""
    res = json.loads(Path(path).read_text())
    args.dtype, args.min_prompts, args.seconds_per_rate = res["dtype"], res["min_prompts"], res["seconds_per_rate"]
    res["date"] = time.strftime("%Y-%m-%d")
    return res


def open_entry(res: dict, workload: str, rates: list[float], runs: list[tuple[str, str]],
               append: bool = False) -> dict:
    """The workload's entry in `res`, its `runs` (setup, SLO set) emptied for new runs, or with
    `append` kept for more (a second run of a point, later); the others' runs kept (an earlier
    map's single auto run, `e`, goes where auto runs again)."""
    entry = res["workloads"].setdefault(workload, {"rates": rates, "setups": {}})
    if any(KINDS[key] == "auto" for key, _ in runs):
        entry["setups"].pop("e", None)
    for key, name in runs:
        if append:
            entry["setups"].setdefault(run_key(key, name), [])
        else:
            entry["setups"][run_key(key, name)] = []
    return entry


def defaults(args: argparse.Namespace) -> None:
    """--out and --workloads where not given: an --add-to map's own path and workloads (runs added
    to a map go into it, for its workloads), else docs/results/winmap.json and all of RATES."""
    earlier = json.loads(Path(args.add_to).read_text())["workloads"] if args.add_to else RATES
    args.out = args.out or args.add_to or "docs/results/winmap.json"
    args.workloads = args.workloads or list(earlier)


def auto_shapes(res: dict, workload: str, slo_sets: set[str]) -> dict[str, str]:
    """The shape auto runs as under each SLO set (as `pdserve up --mode auto --nodes 2 --slo ...
    --workload W` picks it, from the map's profile)."""
    profile = Profile.load(res["profile_path"])
    return {name: shape_for(profile, workload, slos, 2).setup for name, slos in res["slo_sets"].items()
            if name in slo_sets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=None, choices=list(RATES),
                        help="default: all (with --add-to: the earlier map's)")
    parser.add_argument("--rates-for", nargs="+", default=None, metavar="NAME=R1,R2,R3")
    parser.add_argument("--runs", type=int, default=2, help="runs of every measured point")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--min-prompts", type=int, default=40, help="requests per rate at least")
    parser.add_argument("--seconds-per-rate", type=float, default=60.0)
    parser.add_argument("--nodes", type=int, nargs="*", default=[2, 8, 64], help="node counts to simulate")
    parser.add_argument("--auto-at-rate", type=int, nargs="*", default=[], metavar="N",
                        help="node counts to simulate auto at again, its shape picked at each cell's rate "
                             "(`--rate`)")
    parser.add_argument("--profile", default=None, help="auto mode's and the simulator's profile (default: measured)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=None, help="default: docs/results/winmap.json (with --add-to: that map)")
    parser.add_argument("--from-json", default=None, metavar="PATH", help="map, plot and docs from an earlier run")
    parser.add_argument("--add-to", default=None, metavar="PATH",
                        help="run --setups again within an earlier map (its profile, SLOs and rates); their runs "
                             "there are replaced (with --append: kept, and these runs added), the others kept")
    parser.add_argument("--append", action="store_true",
                        help="with --add-to: add --runs more runs of --setups beside their earlier ones")
    parser.add_argument("--auto-slo-sets", nargs="+", default=None, choices=["ttft+tpot", "ttft+itl", "itl"],
                        help="the SLO sets auto runs tuned to (default: all)")
    args = parser.parse_args()
    if args.append and not args.add_to:
        parser.error("--append adds runs to an earlier map: give --add-to PATH")
    for flag, counts in (("--nodes", args.nodes), ("--auto-at-rate", args.auto_at_rate)):
        for n in counts:
            try:
                check_nodes(n, flag)
            except ValueError as e:
                parser.error(str(e))
    defaults(args)
    if args.from_json:
        finish(json.loads(Path(args.from_json).read_text()), args)
        return
    res = earlier_map(args.add_to, args) if args.add_to else fresh_map(args)
    rates = parse_rates(args.rates_for)
    sets, profile_path = res["slo_sets"], res["profile_path"]
    res["setups"].update({k: asdict(SETUPS[k]) for k in args.setups})
    for workload in args.workloads:
        auto = {name: ("--profile", profile_path, "--slo", *goodput_items(s), "--workload", workload)
                for name, s in sets.items()}
        runs = [(key, name) for key in args.setups
                for name in (args.auto_slo_sets or sets if KINDS[key] == "auto" else ["ttft+tpot"])]
        entry = open_entry(res, workload, rates[workload], runs, args.append)
        entry.setdefault("auto_shapes", {}).update(auto_shapes(res, workload, {name for key, name in runs
                                                                              if KINDS[key] == "auto"}))
        for run in range(args.runs):  # the runs of a point apart in time: the host's drift shows as noise
            for key, name in runs:
                auto_run = KINDS[key] == "auto"
                points = run_setup(SETUPS[key], entry["rates"], args.seconds_per_rate, args.min_prompts, args.dtype,
                                   sets[name], workload, auto[name] if auto_run else (),
                                   {name: sets[name]} if auto_run else sets)
                for point in points:
                    point.pop("itls", None)  # per-token gaps: megabytes; the per-request goodputs are kept
                entry["setups"][run_key(key, name)].append(points)
        res["runs"] = max(len(r) for e in res["workloads"].values() for r in e["setups"].values())
        Path(args.out).write_text(json.dumps(res))  # a partial map survives an interrupted run
    finish(res, args)


if __name__ == "__main__":
    main()
