"""The simulator against real runs: the study's setups on this machine, measured and simulated.

    python -m pdserve.benchmarks.simcheck [--rates 0.25 0.5 1.0] [--seconds-per-rate 60] [--min-prompts 150]
                                         [--setups a b c d e] [--workload mixed|multiturn]
                                         [--quick-profile | --profile FILE]

First a fresh profile of this machine's engine (`pdserve profile`, one thread like each node; or
the one given), then the SLOs of the study (benchmarks/study.py), then for each setup and rate the
workload twice (`mixed`, the study's, or `multiturn`: conversations, the rate is of conversations): for real (`pdserve up`, one core per node) and in the simulator with that
profile. The profile gives the costs' shape; their level comes from the idle node the study
measures before the runs (its long-prompt TTFT and lone decode step: idle_level), and follows the
machine's drift from setup to setup (a fixed piece of engine work timed before and after each
setup's runs: this shared host's speed drifts by tens of percent within an hour), and so does the
idle penalty (plan/idle.py: pairs of steps, warm and after 0.3 / 1 / 3 s idle). The relay factors
are measured beside each setup too (plan/corun.py's relay_samples before and after its runs: how much
slower a node steps while the host's proxy relays another node's streams, x1.12-1.36 on one host
within a day). `--real-from`
an earlier JSON simulates its real runs again, with its profile or --profile; `--merge-into` one
runs the given setups for real again on its terms (profile, SLOs, calibration) and replaces them
there (when other load disturbed a setup's runs). Prints the error of
each metric: median and p99 TTFT and TPOT and request throughput relative to the real run, SLO
attainment in points. Targets: medians and throughput within 10 %, p99s within 20 %,
attainment within 10 points.

Setups: the study's (a) colocated x2, (b) with chunked prefill, (c) 1P1D pull, (d) 1P1D push, and
(e) 1P1D `--mode auto` (the cost rule, with the profile above and the study's SLOs).

Writes docs/results/simcheck.json (`multiturn`: simcheck_multiturn.json; with the profile it used),
a PNG beside it (goodput and attainment against rate, simulated dashed against real) and a section
of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from pdserve.benchmarks import host_load
from pdserve.benchmarks.report import publish
from pdserve.benchmarks.study import (
    LONG_INPUT,
    SHORT_INPUT,
    SHORT_OUTPUT,
    WORKLOADS,
    add_sweep_args,
    run_setup,
    study_slos,
    sweep_workload,
)
from pdserve.benchmarks.study import SETUPS as STUDY_SETUPS
from pdserve.benchmarks.study import Setup as StudySetup
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.plan.corun import RELAY_STREAMS, relay_factors, relay_samples
from pdserve.plan.idle import fit_idle, measure_idle, penalty
from pdserve.plan.measure import node_args
from pdserve.plan.profile import Profile, ProfilePoints, describe, run_profile, speed_index, two_cores
from pdserve.plan.sim import Setup, simulate
from pdserve.platform import plan_kernels
from pdserve.workload import goodput_items

RELATIVE = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "request_throughput")
MEDIANS = ("median_ttft_ms", "median_tpot_ms", "request_throughput")  # the ones the 10 % target covers
P99S = ("p99_ttft_ms", "p99_tpot_ms")  # within 20 %
TRACK_IDLE_GAPS_S = (0.3, 1.0, 3.0)  # the idle penalty's pairs beside each setup: ~10 s before and after
GAPS = ("median_max_itl_ms", "p99_max_itl_ms")  # each request's longest gap: reported, not a target
SETUPS = {**STUDY_SETUPS, "e": StudySetup("e", "1P1D auto (cost)", ("--mode", "auto"), "auto:1P1D")}


def errors(real: dict, simulated: dict) -> dict[str, float]:
    """(simulated - real) / real for each metric of RELATIVE; attainment as simulated - real, in points."""
    out = {key: (simulated[key] - real[key]) / real[key] if real.get(key) else float("nan")
           for key in (*RELATIVE, *GAPS)}
    out["slo_attainment_points"] = (simulated["slo_attainment"] - real["slo_attainment"]) * 100
    return out


def paired(real: dict, simulated: dict) -> dict[str, float] | None:
    """Request by request, real over simulated (both ran the same seeded requests, in the same order):
    the p10 / p50 / p90 of each request's TTFT ratio and of its TPOT ratio (answers of 2 tokens or
    more). None where the requests do not pair: another count, or a prompt more than 10 % longer or
    shorter (multiturn's real history is the answers' text tokenized again, a few tokens off). A median of a
    mixture sits between its modes (multiturn's first turns against its later ones), so a shift of a
    few requests moves it by tens of percent while each request is priced right: this says which."""
    lens, other = real.get("input_lens") or [], simulated.get("input_lens") or []
    if not lens or len(lens) != len(other) or any(abs(a - b) > 0.10 * b for a, b in zip(lens, other)) \
            or real.get("output_lens") != simulated.get("output_lens"):
        return None

    def tpot(point: dict, i: int) -> float:
        return (point["e2els"][i] - point["ttfts"][i]) / (point["output_lens"][i] - 1)

    ttft = [r / s for r, s in zip(real["ttfts"], simulated["ttfts"]) if s > 0]
    tpots = [tpot(real, i) / tpot(simulated, i) for i, n in enumerate(real["output_lens"])
             if n > 1 and tpot(simulated, i) > 0]
    out = {}
    for name, ratios in (("ttft", ttft), ("tpot", tpots)):
        if len(ratios) >= 2:
            deciles = statistics.quantiles(ratios, n=10)
            out |= {f"{name}_p10": deciles[0], f"{name}_p50": statistics.median(ratios), f"{name}_p90": deciles[-1]}
    return out or None


def paired_line(ratios: dict[str, float]) -> str:
    def one(name: str) -> str:
        p10, p50, p90 = (ratios[f"{name}_{q}"] for q in ("p10", "p50", "p90"))
        return f"{name.upper()} x{p50:.2f} (p10 x{p10:.2f}, p90 x{p90:.2f})"

    return "request by request, real / simulated: " + ", ".join(
        one(name) for name in ("ttft", "tpot") if f"{name}_p50" in ratios)


def within_targets(err: dict[str, float]) -> bool:
    """Issue 36's: medians and throughput within 10 %, p99s within 20 %, attainment within 10 points."""
    return (all(abs(err[key]) <= 0.10 for key in MEDIANS) and all(abs(err[key]) <= 0.20 for key in P99S)
            and abs(err["slo_attainment_points"]) <= 10)


def simulated_points(profile: Profile, key: str, rates: list[float], seconds_per_rate: float, min_prompts: int,
                     slos: dict[str, float], workload: str) -> list[dict]:
    setup = SETUPS[key]
    return [simulate(profile, Setup.parse(setup.simulated),
                     sweep_workload(workload, i, rate, seconds_per_rate, min_prompts), rate, 1.0, i, slos,
                     max_num_batched_tokens=setup.budget, chunked_prefill=setup.chunked, one_host=True)
            for i, rate in enumerate(rates)]


def relay_now(profile: Profile, samples: list[dict]) -> dict[str, float]:
    """The profile's relay factors as measured beside one setup's runs (relay_samples before and
    after them: the medians over all their rounds); the profile's own where none were."""
    rounds = [r for s in samples for r in s["rounds"]]
    now = relay_factors({"rounds": rounds}) if rounds else {}
    return {k: now.get(k, profile.corun.get(k, 1.0)) for k in ("relay", "relay_decode")}


def idle_now(profile: Profile, samples: list[list[dict]]) -> dict:
    """The idle penalty (plan/idle.py) fitted to the pairs measured beside one setup's runs (before
    and after them, pooled): like the host's speed, it moves within a day (docs/benchmarks.md); the
    profile's where none were."""
    pooled = [pair for s in samples for pair in s]
    return fit_idle(pooled) if pooled else profile.idle


def auto_args(setup: StudySetup, profile_path: Path, slos: dict[str, float]) -> tuple[str, ...]:
    """What `pdserve up --mode auto` adds: the profile to price placements with, the SLOs to keep."""
    if "auto" not in setup.up_args:
        return ()
    return ("--profile", str(profile_path), "--slo", *goodput_items(slos))


def idle_level(profile: Profile, idle: dict) -> dict[str, float]:
    """Measured / predicted for the idle node the study measures before the runs (one `pdserve
    serve`, pinned, over HTTP): its 2048-token TTFT sets the level of prefill costs, its lone
    decode step (a 128 -> 128 request) that of decode steps. The profile keeps the shape (how costs
    grow with tokens, sequences, context): the in-process engine it was measured on ran 20-25 %
    off the served nodes on this host, in either direction."""
    serving = profile.serving
    budget = profile.meta["node"]["max_num_batched_tokens"]
    long_ttft = (profile.prefill_time(LONG_INPUT, budget) + serving["request_s"] + serving["stream_s"]
                 + serving["step_s"] * -(-LONG_INPUT // budget))
    step = profile.decode_step_time(1, SHORT_INPUT + SHORT_OUTPUT // 2) + serving["step_s"]
    return {"prefill": idle["ttft_long_ms"] / 1e3 / long_ttft, "decode": idle["decode_step_ms"] / 1e3 / step}


def table(res: dict) -> str:
    lines = ["| setup | rate (/s) | median TTFT real / sim (ms) | p99 TTFT | median TPOT | p99 TPOT | "
             "throughput real / sim (req/s) | attainment real / sim (%) | errors (TTFT p50, p99, TPOT p50, p99, "
             "throughput; attainment points) | within targets | longest gap p50, p99 real / sim (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, s in res["setups"].items():
        for rate, real, sim, err in zip(res["rates"], s["real"], s["simulated"], s["errors"]):
            pair = lambda k, fmt="{:.0f}": f"{fmt.format(real[k])} / {fmt.format(sim[k])}"  # noqa: E731
            errs = ", ".join(f"{err[k] * 100:+.0f} %" for k in RELATIVE) + f"; {err['slo_attainment_points']:+.0f}"
            lines.append(f"| ({key}) {s['label']} | {rate:g} | {pair('median_ttft_ms')} | {pair('p99_ttft_ms')} | "
                         f"{pair('median_tpot_ms')} | {pair('p99_tpot_ms')} | {pair('request_throughput', '{:.2f}')} | "
                         f"{real['slo_attainment'] * 100:.0f} / {sim['slo_attainment'] * 100:.0f} | {errs} | "
                         f"{'yes' if within_targets(err) else 'no'} | {gaps(real, sim)} |")
    return "\n".join(lines)


def gaps(real: dict, sim: dict) -> str:
    """The longest-gap cell: p50 and p99 of each request's longest gap, real / simulated."""
    if not all(k in real for k in GAPS):
        return "-"  # a run recorded before they were
    return ", ".join(f"{real[k]:.0f} / {sim[k]:.0f}" for k in GAPS)


# The proxy's split of TTFT (proxy/timing.py): P's queue, P's answer after it (of which P's engine's
# own), the proxy's handoff to D (pull), D's queue, the KV wait that showed, D's engine's own TTFT
STAGES = ("queue", "prefill", "prefill-engine", "handoff", "decode-queue", "kv-load", "decode-ttft")


def stage_medians(point: dict) -> dict[str, float]:
    """Each TTFT stage's median over the point's requests (those that have it), in ms."""
    out = {}
    for stage in STAGES:
        values = [s[stage] for s in point.get("stages_ms", []) if s and stage in s]
        if values:
            out[stage] = statistics.median(values)
    return out


def stages_line(real: dict, sim: dict) -> str:
    """Where TTFT went, real / simulated medians: which stage a TTFT error comes from."""
    r, s = stage_medians(real), stage_medians(sim)
    return "TTFT stages (median ms) real / sim: " + ", ".join(f"{k} {pair(r, s, k)}" for k in r)


def where_table(res: dict) -> str:
    """Where each point's TTFT and TPOT went, real / simulated: the stage medians (the rest: the
    hops to the answering node, its wait for a step to end, the stream) and the decode-only steps."""
    lines = ["| setup | rate (/s) | queue + prefill (ms) | of which P's engine | kv-load | rest of median TTFT | "
             "D's engine TTFT | decode-only step (ms) | its batch |", "|---|---|---|---|---|---|---|---|---|"]
    for key, s in res["setups"].items():
        for rate, real, sim in zip(res["rates"], s["real"], s["simulated"]):
            r, m = stage_medians(real), stage_medians(sim)
            if not r or not m:
                continue  # a run recorded before the stages were
            before = [sum(x.get(k, 0.0) for k in ("queue", "prefill")) for x in (r, m)]
            kv = [x.get("kv-load", 0.0) for x in (r, m)]
            rest = [p["median_ttft_ms"] - b - k for p, b, k in zip((real, sim), before, kv)]
            steps = real.get("host_reading", {})
            d = (steps.get("decode_steps"), steps.get("simulated_decode_steps"))
            step = f"{d[0]['mean_step_ms']:.1f} / {d[1]['mean_step_ms']:.1f}" if all(d) else "-"
            batch = f"{d[0]['mean_seqs']:.2f} / {d[1]['mean_seqs']:.2f}" if all(d) else "-"
            engine = [pair(r, m, k) for k in ("prefill-engine", "decode-ttft")]
            lines.append(f"| ({key}) {s['label']} | {rate:g} | {before[0]:.0f} / {before[1]:.0f} | {engine[0]} | "
                         f"{kv[0]:.0f} / {kv[1]:.0f} | {rest[0]:.0f} / {rest[1]:.0f} | {engine[1]} | {step} | {batch} |")
    return "\n".join(lines)


def pair(real: dict[str, float], sim: dict[str, float], stage: str) -> str:
    """A stage's real / simulated median, `-` where a run did not record it (P and D apart only, or
    a stage the simulator does not give)."""
    return f"{real[stage]:.0f} / {sim[stage]:.0f}" if stage in real and stage in sim else "-"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for n, (key, s) in enumerate(res["setups"].items()):
        color = f"C{n}"
        for kind, style in (("real", "-"), ("simulated", "--")):
            label = f"({key}) {s['label']}, {kind}"
            axes[0].plot(res["rates"], [p["request_goodput"] for p in s[kind]], style, color=color, marker="o", label=label)
            axes[1].plot(res["rates"], [p["slo_attainment"] * 100 for p in s[kind]], style, color=color, marker="o")
    axes[0].set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="goodput: real (solid), simulated (dashed)")
    axes[1].set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", title="SLO attainment")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser, [0.25, 0.5, 1.0], 60.0, 150, SETUPS)
    parser.add_argument("--workload", default="mixed", choices=WORKLOADS)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--profile", default=None, help="use this profile instead of measuring a fresh one")
    source.add_argument("--quick-profile", action="store_true", help="measure the fresh profile with --quick")
    parser.add_argument("--out", default=None, help="default: docs/results/simcheck.json (multiturn: "
                        "simcheck_multiturn.json)")
    parser.add_argument("--no-track-speed", dest="track_speed", action="store_false",
                        help="simulate with the profile as measured, not scaled to the machine's speed at each setup")
    parser.add_argument("--no-track-relay", dest="track_relay", action="store_false",
                        help="simulate with the profile's relay factors, not those measured beside each setup's runs "
                             "(or recorded there, with --real-from)")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="do not set the costs' level from the idle node measured before the runs")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--real-from", default=None, metavar="JSON",
                       help="take the real runs, rates and SLOs from an earlier simcheck JSON; simulate again")
    again.add_argument("--merge-into", default=None, metavar="JSON",
                       help="run --setups for real again with that run's profile, rates, SLOs and calibration, and "
                            "replace them in it (a setup whose runs other load on the host disturbed)")
    args = parser.parse_args()
    args.dtype = plan_kernels(args.dtype).dtype
    earlier = json.loads(Path(args.real_from).read_text()) if args.real_from else None
    base = json.loads(Path(args.merge_into).read_text()) if args.merge_into else None
    if earlier:
        args.setups = list(earlier["setups"])
    for run in (earlier, base):
        if run:
            args.rates, args.seconds_per_rate = run["rates"], run["seconds_per_rate"]
            args.min_prompts = run.get("min_prompts", args.min_prompts)
            args.workload = run.get("workload", "mixed")
            args.dtype = run["dtype"]  # the real runs' (this machine's default may differ)
    if base:
        args.out = args.merge_into
    earlier_profile = (earlier or base or {}).get("profile")

    suffix = "" if args.workload == "mixed" else f"_{args.workload}"
    args.out = args.out or f"docs/results/simcheck{suffix}.json"
    profile_path = Path(args.out).with_name(f"simcheck{suffix}_profile.json")  # auto mode's nodes read it
    if args.profile:
        profile = Profile.load(args.profile)
    elif earlier_profile and not args.quick_profile:  # the profile that run measured
        profile_path.write_text(json.dumps(earlier_profile))
        profile = Profile.load(profile_path)
    else:  # measured alone on the machine, before any node starts
        points = ProfilePoints.quick() if args.quick_profile else ProfilePoints.full()
        profile = run_profile(EngineConfig(dtype=args.dtype, threads=1), points)
        profile.save(profile_path)
    print(describe(profile), flush=True)
    if earlier or base:
        idle, slos = (earlier or base)["idle"], (earlier or base)["slos_ms"]
    else:
        idle, slos = study_slos(args.dtype, args.ttft_scale, args.tpot_scale)
    print(f"idle latencies {idle}; SLOs {slos}", flush=True)

    source = args.profile or (earlier["profile_source"] if earlier else "fresh")
    res: dict = {"date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "workload": args.workload, "rates": args.rates,
                 "seconds_per_rate": args.seconds_per_rate, "min_prompts": args.min_prompts, "slos_ms": slos,
                 "idle": idle, "profile": asdict(profile), "profile_source": source, "setups": {},
                 "real_from": (earlier.get("real_from") or earlier["date"]) if earlier else None,
                 "reruns": earlier.get("reruns", {}) if earlier else {}, "track_relay": args.track_relay}
    # The machine's speed now, before and after each setup's runs, against the profile's: a
    # shared host drifts by tens of percent, and the simulation should predict the runs it faces.
    engine = None if earlier or not args.track_speed else LLMEngine(EngineConfig(dtype=args.dtype, threads=1))
    # The relay's cost too (a minute before and after each setup): it follows the host's state, and
    # no one factor fitted two runs of one host a day apart (docs/benchmarks.md).
    relay_cores = None if earlier or not args.track_relay or not profile.corun_measured \
        else two_cores(EngineConfig(dtype=args.dtype, threads=1))
    # The drift the idle node was measured at (that of the first setup run after it), as recorded:
    # a setup run again later (--merge-into) records its own.
    level, first_drift = idle_level(profile, idle), (earlier or base or {}).get("idle_drift")
    if base and not first_drift:  # a run recorded before idle_drift was: its first setup's
        first_drift = next(iter(base["setups"].values()))["drift"]
    res["idle_level"] = level
    for key in args.setups:
        setup = SETUPS[key]
        if earlier:
            real, speed = earlier["setups"][key]["real"], earlier["setups"][key].get("speed", [])
            relay = earlier["setups"][key].get("relay", [])
            cold = earlier["setups"][key].get("idle_samples", [])
        else:
            seed = 10_000 * (1 + args.setups.index(key))  # fresh prompts for every speed_index
            speed = [speed_index(engine, seed)] if engine else []
            cold = [measure_idle(engine, seed + 500, rounds=1, gaps=TRACK_IDLE_GAPS_S)] if engine else []
            relay = [relay_samples(node_args(args.dtype), relay_cores, rounds=2)] if relay_cores else []
            real = run_setup(setup, args.rates, args.seconds_per_rate, args.min_prompts, args.dtype, slos,
                             args.workload, auto_args(setup, Path(args.profile or profile_path), slos))
            relay += [relay_samples(node_args(args.dtype), relay_cores, rounds=2)] if relay_cores else []
            speed += [speed_index(engine, seed + 1000)] if engine else []
            cold += [measure_idle(engine, seed + 1500, rounds=1, gaps=TRACK_IDLE_GAPS_S)] if engine else []
        now = {k: statistics.mean(s[k] for s in speed) for k in ("prefill_s", "decode_s")} if speed else {}
        drift = profile.speed_factors(now) if now else {"prefill": 1.0, "decode": 1.0}
        first_drift = res["idle_drift"] = first_drift or drift  # the idle node was measured just before it
        factors = {k: level[k] * drift[k] / first_drift[k] for k in level} if args.calibrate else drift
        print(f"[{key}] costs scaled by prefill x{factors['prefill']:.2f}, decode x{factors['decode']:.2f} "
              f"(machine drift against the profile: x{drift['prefill']:.2f}, x{drift['decode']:.2f})", flush=True)
        relayed = relay_now(profile, relay if args.track_relay else [])
        whose = "measured beside its runs" if relay and args.track_relay else "the profile's"
        print(f"[{key}] relay factors x{relayed['relay']:.2f} (prefill), x{relayed['relay_decode']:.2f} (decode), "
              f"{whose}", flush=True)
        after_idle = idle_now(profile, cold)
        whose = "measured beside its runs" if cold else "the profile's"
        print(f"[{key}] a step after 1 s idle pays {penalty(after_idle, 1.0, True) * 1e3:.0f} ms more (prefill), "
              f"{penalty(after_idle, 1.0, False) * 1e3:.0f} ms (decode), {whose}", flush=True)
        now_profile = replace(profile.scaled(factors), corun={**profile.corun, **relayed}, idle=after_idle)
        sim = simulated_points(now_profile, key, args.rates, args.seconds_per_rate, args.min_prompts, slos,
                               args.workload)
        for point in real + sim:  # per-token gaps: megabytes, and their percentiles are in the summaries
            point.pop("itls", None)
        res["setups"][key] = {"label": setup.label, "simulated_as": setup.simulated, "real": real, "simulated": sim,
                              "speed": speed, "drift": drift, "cost_factors": factors, "relay": relay,
                              "relay_factors": relayed, "relay_tracked": bool(relay and args.track_relay),
                              "idle_samples": cold, "idle_fit": after_idle,
                              "errors": [errors(r, s) for r, s in zip(real, sim)],
                              "paired": [paired(r, s) for r, s in zip(real, sim)]}
        for rate, err, point, simulated in zip(args.rates, res["setups"][key]["errors"], real, sim):
            print(f"[{key}] rate {rate}: " + ", ".join(f"{k} {v * 100:+.0f} %" for k, v in err.items() if k in RELATIVE)
                  + f", attainment {err['slo_attainment_points']:+.0f} points", flush=True)
            if "host_load" in point:  # runs recorded since host_load was
                point["host_reading"] = host_load.against_profile(point["host_load"], now_profile,
                                                                  point["total_output_tokens"])
                print(f"[{key}] rate {rate}: {host_load.line(point['host_reading'])}", flush=True)
                point["host_reading"]["decode_steps"] = steps = host_load.decode_steps(point["host_load"]["decode"])
                point["host_reading"]["simulated_decode_steps"] = sim_steps = host_load.decode_steps(
                    simulated["decode_counters"])
                print(f"[{key}] rate {rate}: {host_load.steps_line(steps, sim_steps)}", flush=True)
            print(f"[{key}] rate {rate}: {stages_line(point, simulated)}", flush=True)
            if ratios := paired(point, simulated):
                print(f"[{key}] rate {rate}: {paired_line(ratios)}", flush=True)
    if engine:
        engine.close()
    if base:  # the setups run again replace theirs; the rest stay as that run measured them
        res = {**base, "setups": {**base["setups"], **res["setups"]},
               "reruns": {**base.get("reruns", {}), **{key: res["date"] for key in args.setups}}}
    all_errors = [e for s in res["setups"].values() for e in s["errors"]]
    res["within_targets"] = sum(within_targets(e) for e in all_errors)
    res["points"] = len(all_errors)
    finish(res, args)


def corun_note(res: dict) -> str:
    """The co-run and relay factors the simulation applied (every node on one core of this host), and
    a pull's served handoff."""
    profile = res["profile"]
    corun = profile.get("corun")
    if not corun:
        return ""
    note = (f". Every node on its own core of this host: a step ran x{corun['prefill']:.2f} (prefill) and "
            f"x{corun['decode']:.2f} (decode) slower while another node computed (the profile's co-run factors)")
    if "relay" in corun:
        note += f"; a prefill x{corun['relay']:.2f}"
        if "relay_decode" in corun:
            note += f" and a decode step x{corun['relay_decode']:.2f} (while another node computed)"
        note += (f" while other nodes had {RELAY_STREAMS} streams or more under way, in proportion below that "
                 "(the relay factors: the proxy relaying their tokens on the node's core)")
        # Per setup: a setup run again (--merge-into) says for itself (runs before relay_tracked: the run's flag).
        tracked = {k: s["relay_factors"] for k, s in res["setups"].items()
                   if s.get("relay_tracked", bool(s.get("relay")) and res.get("track_relay"))}
        if tracked:
            note += ("; those measured beside each setup's runs (relay_samples before and after them) replaced them: "
                     + ", ".join(f"({k}) x{f['relay']:.2f} / x{f['relay_decode']:.2f}" for k, f in tracked.items()))
    handoff = profile.get("serving", {}).get("pull_handoff_s")
    if handoff is not None:
        note += f"; a pull's served handoff {handoff * 1e3:.1f} ms on top of its bytes' transfer"
    fits = {k: s["idle_fit"] for k, s in res["setups"].items() if s.get("idle_samples")}
    if fits:
        note += ("; a node's first step after it idled 1 s paid more (plan/idle.py: prefill / decode, measured "
                 "beside each setup's runs): " + ", ".join(f"({k}) {penalty(f, 1.0, True) * 1e3:.0f} / "
                                                          f"{penalty(f, 1.0, False) * 1e3:.0f} ms"
                                                          for k, f in fits.items()))
    return note


def paired_note(res: dict) -> str:
    """The median over requests of each one's TTFT and TPOT ratio, real / simulated, per setup and
    rate (paired); "" for runs recorded before it was."""
    def cell(ratios: dict | None) -> str:
        if not ratios or "ttft_p50" not in ratios:
            return "-"
        return f"x{ratios['ttft_p50']:.2f}" + (f" / x{ratios['tpot_p50']:.2f}" if "tpot_p50" in ratios else "")

    setups = {k: s["paired"] for k, s in res["setups"].items() if any(s.get("paired") or [])}
    if not setups:
        return ""
    return ("\n\nRequest by request (each real request against its simulated twin), the median of real / "
            "simulated TTFT / TPOT at each rate (a median of TTFTs can sit between a mixture's modes, where a "
            "few requests move it by 10 % or more): "
            + "; ".join(f"({k}) " + ", ".join(cell(r) for r in ratios) for k, ratios in setups.items()) + ".")


def finish(res: dict, args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(res, png)
    again = f"; real runs of {res['real_from']}, simulated again" if res.get("real_from") else ""
    again += "".join(f"; ({key}) run again on {day} (`--merge-into`)" for key, day in res.get("reruns", {}).items())
    workload = res.get("workload", "mixed")
    meta = res["profile"]["meta"]
    body = (f"Measured on {meta.get('cpu', 'this CPU')} ({meta.get('isa', '?')}, {meta['engine']['dtype']} "
            f"{meta['engine']['quantization']}, one core per node). "
            f"Command: `python -m pdserve.benchmarks.simcheck --workload {workload} --rates "
            f"{' '.join(f'{r:g}' for r in res['rates'])} --seconds-per-rate {res['seconds_per_rate']:g} "
            f"--min-prompts {res['min_prompts']} --setups {' '.join(res['setups'])}` ({res['date']}, {res['dtype']}, profile: "
            f"{res['profile_source']}{again}). SLOs as in the study: TTFT {res['slos_ms']['ttft_ms']:.0f} ms, "
            f"TPOT {res['slos_ms']['tpot_ms']:.0f} ms. Errors are (simulated - real) / real; attainment in points.\n\n"
            f"{table(res)}\n\nCost factors (prefill, decode) per setup, idle level x drift: "
            + ", ".join(f"({k}) x{v['cost_factors']['prefill']:.2f} / x{v['cost_factors']['decode']:.2f}"
                        for k, v in res["setups"].items())
            + corun_note(res) + "."
            + paired_note(res)
            + "\n\nWhere the time went, real / simulated: medians of the stages the proxy's x-pdserve-*-ms "
            "headers split TTFT into (the rest: the hops to the answering node, its wait for a step to end, the "
            "stream; P's and D's engines' own times, where recorded, tell the nodes' HTTP and the proxy's hops "
            "from the engines), and each point's decode-only steps as the nodes count them (pdserve:decode_steps).\n\n"
            + where_table(res)
            + f"\n\n{res['within_targets']} of {res['points']} points within the targets (medians and "
            f"throughput within 10 %, p99s within 20 %, attainment within 10 points).\n\n"
            f"![simulated against real](results/{png.name})")
    section = "simcheck" if workload == "mixed" else f"simcheck_{workload}"
    publish(res, str(out), section, f"Simulator against real runs (simcheck, {workload})", body)


if __name__ == "__main__":
    main()
