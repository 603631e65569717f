"""`pdserve plan`: the fewest nodes that serve a load within SLOs, searched with the simulator.

    pdserve plan --profile profile.json --dataset mixed --rate 40 --goodput ttft:8000 tpot:60
                 [--attainment 0.9] [--max-nodes 1000]

Setups are families of a unit repeated k times: colocated nodes (with or without chunked
prefill; under an ITL SLO also with a prefill cap while decoding that fits it, prefill_cap_for;
and with prefill and decode taking turns, a cap of 0),
pull or push units of x P and y D nodes for the P:D ratios of RATIOS, and auto over pairs of
kv_both nodes (per request: prefill where it decodes, or on the other node and pull); then each
P/D family again with per-role settings (P's token budget, D's most streams, and with
--thread-profile, P or D nodes of more threads: role_variants). For each family the planner finds
the smallest k whose simulated SLO attainment reaches the target (attainment grows with k), by
bisection between 1 and --max-nodes, or, where a family of its P:D ratio is solved (pull for push,
colocated for colocated nodes of other settings, the family for its per-role variants), from that
size outward. Sizes count cores: a node of t threads counts t, so a
family of fatter nodes wins only where it needs fewer cores. A bisection step stops its
simulation as soon as the target is out of reach (simulate's give_up_below); the largest size,
which the report shows even when it fails, runs whole.

Only the cheapest setup is the answer, so by default a family is sized only up to the cores of the
cheapest passing family found before it: one that cannot pass there is reported as needing more
(not sized), after one simulation that stops as soon as it cannot reach the target
(`--size-every-family` sizes each exactly, as `python -m pdserve.benchmarks.plans` does for its
best colocated and best PD columns). The pick is the same either way: a family tuned with per-role
settings in one mode is tuned in the other (a P/D family not sized is tried once at twice the
cheapest's cores, which decides that as its size would: Planner.within).

A cluster of k units is simulated as one unit that receives every k-th request: the proxy's
round robin hands each node every (k * its count)-th request, so a unit sees the load's arrivals
thinned k times, i.e. gamma gaps of shape k (with Poisson arrivals) at rate / k. That keeps a
1,000-node question as cheap as a one-unit one; what it leaves out is the proxy's least-loaded
choice across units (round robin is what the unit sees).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pdserve.plan.profile import Profile
from pdserve.plan.sim import Setup, simulate
from pdserve.workload import BenchRequest

RATIOS = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 3), (1, 4), (1, 6))
MAX_NODES = 1000
# Per-role settings tried on each P/D family, one at a time: P's token budget per step (the
# node's own is the profile's, 2048 by default) and D's most streams (64): a D that takes fewer
# streams decodes each faster (a step grows with its batch), at the cost of queueing the rest.
PREFILL_BUDGETS = (512,)
DECODE_MAX_SEQS = (4, 8, 16)


def check_rate(rate: float) -> None:
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"--rate {rate:g}: expected a finite number of requests per second > 0")


def check_nodes(nodes: int, flag: str = "--nodes") -> None:
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"{flag} {nodes}: expected 1 to {MAX_NODES}")


@dataclass(frozen=True)
class Family:
    """A unit that a cluster repeats: `prefill` P and `decode` D nodes, or `decode` colocated (or,
    auto, kv_both) ones."""

    mode: str
    prefill: int
    decode: int
    chunked: bool = True
    prefill_cap: int | None = None  # colocated: --max-prefill-tokens-while-decoding
    prefill_budget: int | None = None  # P/D: P nodes' --max-num-batched-tokens (None: the node's own)
    decode_max_seqs: int | None = None  # P/D: D nodes' --max-num-seqs (None: the node's own)
    prefill_threads: int | None = None  # P/D: P nodes' threads (None: the profile's, one)
    decode_threads: int | None = None  # P/D: D nodes' threads

    @property
    def unit_nodes(self) -> int:
        return self.prefill + self.decode

    @property
    def unit_cores(self) -> int:
        """Cores a unit takes: a thread each."""
        return self.prefill * (self.prefill_threads or 1) + self.decode * (self.decode_threads or 1)

    def cluster(self, units: int) -> Setup:
        """`units` of this family as the simulator's Setup."""
        return Setup(self.mode, units * self.prefill, units * self.decode, self.prefill_budget, self.decode_max_seqs,
                     self.prefill_threads, self.decode_threads)

    def setup(self, units: int) -> str:
        """The whole cluster, as `pdserve simulate --setup` and `pdserve up` name it."""
        cap = f" (--max-prefill-tokens-while-decoding {self.prefill_cap})" if self.prefill_cap is not None else ""
        if self.mode == "colocated":
            return f"colocated:{units * self.decode}" + ("" if self.chunked else " (no chunked prefill)") + cap
        if self.mode == "auto" and not self.prefill:
            return f"auto:{units * self.decode}{cap}"
        roles = self.cluster(units).role_flags
        return f"{self.mode}:{units * self.prefill}P{units * self.decode}D" + (f" ({roles})" if roles else "")

    @property
    def name(self) -> str:
        cap = ("" if self.prefill_cap is None else ", prefill and decode take turns" if self.prefill_cap == 0
               else f", prefill cap {self.prefill_cap} while decoding")
        if self.mode == "auto" and not self.prefill:
            return f"auto, {self.decode} kv_both nodes a unit{cap}"
        if self.mode == "colocated":
            return "colocated" + ("" if self.chunked else ", no chunked prefill") + cap
        roles = (f", P budget {self.prefill_budget}" if self.prefill_budget else "") + \
            (f", D at most {self.decode_max_seqs} streams" if self.decode_max_seqs else "") + \
            (f", P of {self.prefill_threads} threads" if self.prefill_threads else "") + \
            (f", D of {self.decode_threads} threads" if self.decode_threads else "")
        return f"{self.mode} {self.prefill}P:{self.decode}D{roles}"


def role_variants(family: Family, threads: tuple[int, ...] = ()) -> list[Family]:
    """A P/D family with each per-role setting of PREFILL_BUDGETS and DECODE_MAX_SEQS tried alone,
    and its P, or its D, nodes at each thread count of `threads` (those profiled)."""
    if not family.prefill:
        return []
    return ([replace(family, prefill_budget=b) for b in PREFILL_BUDGETS]
            + [replace(family, decode_max_seqs=m) for m in DECODE_MAX_SEQS]
            + [replace(family, prefill_threads=t) for t in threads]
            + [replace(family, decode_threads=t) for t in threads])


def families(profile: Profile | None = None, slos: dict[str, float] | None = None) -> list[Family]:
    out = [Family("colocated", 0, 1), Family("colocated", 0, 1, chunked=False)]
    cap = None
    if profile is not None and slos and "max_itl_ms" in slos:
        cap = prefill_cap_for(profile, slos["max_itl_ms"] / 1e3)
        if cap:
            out.append(Family("colocated", 0, 1, prefill_cap=cap))
    # Prefill and decode taking turns, under any SLOs: it won chat's TTFT + TPOT cells at 0.4 and
    # 0.5 req/s too (docs/benchmarks.md, ninth look), a stream's mean absorbing no stall at all.
    out.append(Family("colocated", 0, 1, prefill_cap=0))
    for mode in ("pull", "push"):
        out += [Family(mode, p, d) for p, d in RATIOS]
    return out + [Family("auto", 0, 2, prefill_cap=cap)]  # as `pdserve up --mode auto --slo itl:MS` caps them


def prefill_cap_for(profile: Profile, itl_s: float, seqs: int = 8, context: int = 1024,
                    share: float = 0.75) -> int:
    """The largest prompt chunk (whole blocks of 16) that a step beside `seqs` decoding streams of
    `context` tokens can take and stay within `share` of the ITL SLO (the rest: serving's hops and
    the host's noise). 0 where not even 16 tokens fit: then every step that prefills beside a
    stream misses the SLO, so a prompt waits until the node's streams have finished (prefill and
    decode take turns; a small cap would only stretch the prefill over more such steps: session
    29's 16-token cap queued prompts to a p99 TTFT of 7.7-10.6 s)."""
    step = profile.decode_step_time(seqs, seqs * context)
    cap = 0
    while cap < 8192 and step + profile.prefill_chunk_time(cap + 16, context) <= share * itl_s:
        cap += 16
    return cap


@dataclass
class Choice:
    """A family at its smallest passing size (or at the largest size tried, if none passed)."""

    family: Family
    units: int
    meets: bool
    summary: dict

    @property
    def nodes(self) -> int:
        return self.units * self.family.unit_nodes

    @property
    def cores(self) -> int:
        return self.units * self.family.unit_cores

    def goodput(self, rate: float) -> float:
        """Requests per second that meet the SLOs, for the whole cluster."""
        return rate * self.summary["slo_attainment"]


class Planner:
    def __init__(self, profile: Profile, requests: list[BenchRequest], rate: float, slos: dict[str, float],
                 attainment: float, max_nodes: int, seed: int = 0,
                 thread_profiles: dict[int, Profile] | None = None, size_every_family: bool = False) -> None:
        if not slos:
            raise ValueError("--goodput: give the SLOs to plan for, e.g. ttft:2000 tpot:60")
        if not 0 < attainment <= 1:
            raise ValueError(f"--attainment {attainment}: expected a fraction in (0, 1], e.g. 0.9")
        check_nodes(max_nodes, "--max-nodes")
        check_rate(rate)
        self.profile, self.requests, self.rate, self.slos = profile, requests, rate, slos
        self.attainment, self.max_nodes, self.seed = attainment, max_nodes, seed
        self.thread_profiles = thread_profiles or {}  # threads -> profile: nodes of that many are tried too
        self.size_every_family = size_every_family  # else a family past the cheapest so far is not sized
        self.simulated_requests = 0

    def evaluate(self, family: Family, units: int, whole: bool = False) -> dict:
        """One unit's summary when the cluster has `units` of them (see the module's docstring).
        Unless `whole`, a run that cannot reach the attainment any more stops there (its summary
        then holds only an upper bound of it: the bisection needs no more)."""
        summary = simulate(self.profile, family.cluster(1), self.requests, self.rate / units, float(units), self.seed,
                           self.slos, chunked_prefill=family.chunked, itls=False, prefill_cap=family.prefill_cap,
                           give_up_below=None if whole else self.attainment, thread_profiles=self.thread_profiles)
        self.simulated_requests += summary["simulated_requests"]
        return summary

    def passes(self, summary: dict) -> bool:
        return summary["slo_attainment"] >= self.attainment

    def smallest(self, family: Family, max_cores: int | None = None, report: bool = True,
                 guess: int | None = None) -> Choice | None:
        """The family's smallest passing size of at most `max_cores` (default: the planner's
        --max-nodes, nodes of one thread); a failing Choice at the largest size (its summary whole
        where `report`, else perhaps only an upper bound of its attainment); None if no unit fits.
        `guess`, a size near the answer (a solved family's of the same shape), is tried first and
        the search gallops away from it until the answer is bracketed: 2 simulations where the
        guess is right, against about log2(--max-nodes) for a bisection from the whole range."""
        top = (max_cores or self.max_nodes) // family.unit_cores
        if top < 1:
            return None
        if guess is not None and 1 <= guess < top:
            summary = self.evaluate(family, guess)
            if self.passes(summary):
                return self._below(family, guess, summary)
            bracket = self._above(family, guess, top, report)
            if isinstance(bracket, Choice):
                return bracket
            lo, hi, best = bracket
        else:
            summary = self.evaluate(family, top, whole=report)  # the report shows it even when it fails
            if not self.passes(summary):
                return Choice(family, top, False, summary)
            lo, hi, best = 1, top, summary
        return self._bisect(family, lo, hi, best)

    def _below(self, family: Family, hi: int, best: dict) -> Choice:
        """`hi` passes: probe 1, 2, 4, ... sizes below it until one fails, then bisect the gap."""
        step = 1
        while hi - step >= 1:
            summary = self.evaluate(family, hi - step)
            if not self.passes(summary):
                return self._bisect(family, hi - step + 1, hi, best)
            hi, best, step = hi - step, summary, step * 2
        return self._bisect(family, 1, hi, best)

    def _above(self, family: Family, failed: int, top: int, report: bool) -> Choice | tuple[int, int, dict]:
        """`failed` fails: probe 1, 2, 4, ... sizes above it until one passes, (lo, hi, its summary)
        to bisect; where that reaches `top`, the top size as the search from the whole range runs it."""
        lo, step = failed + 1, 1
        while (probe := lo + step - 1) < top:
            summary = self.evaluate(family, probe)
            if self.passes(summary):
                return lo, probe, summary
            lo, step = probe + 1, step * 2
        summary = self.evaluate(family, top, whole=report)
        return (lo, top, summary) if self.passes(summary) else Choice(family, top, False, summary)

    def _bisect(self, family: Family, lo: int, hi: int, best: dict) -> Choice:
        """The smallest passing size in [lo, hi], where `hi` passes with summary `best`."""
        while lo < hi:
            mid = (lo + hi) // 2
            summary = self.evaluate(family, mid)
            if self.passes(summary):
                hi, best = mid, summary
            else:
                lo = mid + 1
        return Choice(family, hi, True, best)

    def tuned(self, choices: list[Choice], unsized: list[Family]) -> list[Choice]:
        """Each P/D family's best per-role variant (role_variants) where it beats the family with
        the node's own settings: fewer nodes, or as many and more requests within the SLOs. Only
        sizes up to the best choice so far are searched (a larger cluster cannot be the pick), and
        only families within twice its size are tuned (beyond, a setting would have to halve the
        family to win; a family not sized is tried at twice the size). Where nothing passes,
        nothing is tuned: the report names the closest setup."""
        passing = [c for c in choices if c.meets]
        if not passing:
            return []
        bound = min(passing, key=rank).cores
        bases = [c for c in choices if c.family.prefill and c.cores <= 2 * bound]
        bases += [Choice(f, 0, False, {}) for f in unsized if f.prefill and self.within(f, 2 * bound)]
        out = []
        for base in bases:
            # A variant that fails at the bound is not reported: its run may stop as soon as it fails
            variants = [self.smallest(f, bound, report=False, guess=base.units if base.meets else None)
                        for f in role_variants(base.family, tuple(self.thread_profiles))]
            best = min((c for c in variants if c is not None and c.meets), key=rank, default=None)
            if best is not None and (not base.units or rank(best) < rank(base)):
                out.append(best)
        return out

    def within(self, family: Family, cores: int) -> bool:
        """Would the family, sized exactly, take at most `cores`: it passes there, or (not passing
        anywhere) its largest size, at which the report would show it, is no more."""
        top = self.max_nodes // family.unit_cores
        if top * family.unit_cores <= cores:
            return True
        units = cores // family.unit_cores
        return units >= 1 and self.passes(self.evaluate(family, units))

    def plan(self) -> dict:
        start = time.perf_counter()
        choices: list[Choice] = []
        unsized: dict[Family, int] = {}  # a family that cannot pass at the cheapest so far: those cores
        for family in families(self.profile, self.slos):
            bound = None if self.size_every_family else min((c.cores for c in choices if c.meets), default=None)
            choice = self.smallest(family, bound, report=bound is None, guess=guess_from(family, choices))
            if choice is not None and (choice.meets or bound is None):
                choices.append(choice)
            elif bound is not None:
                unsized[family] = bound
        choices += self.tuned(choices, list(unsized))
        passing = sorted((c for c in choices if c.meets), key=rank)
        return {"rate": self.rate, "slos_ms": self.slos, "attainment": self.attainment, "max_nodes": self.max_nodes,
                "num_prompts": len(self.requests), "pick": row(passing[0], self.rate) if passing else None,
                "setups": [row(c, self.rate) for c in sorted(choices, key=lambda c: (not c.meets, c.cores))],
                "not_sized": [{"family": f.name, "more_than_cores": cores} for f, cores in unsized.items()],
                "simulated_requests": self.simulated_requests, "seconds": time.perf_counter() - start}


def guess_from(family: Family, solved: list[Choice]) -> int | None:
    """A first size to try for `family`: that of the last passing family of its P:D ratio (pull
    and push of one ratio; colocated nodes with other settings, and auto's pairs, as colocated),
    for as many cores. They need about as many: pull and push of a ratio the same size at 200
    cores (docs/benchmarks.md)."""
    def share(f: Family) -> float:
        return f.prefill / f.unit_nodes if f.mode != "auto" else 0.0  # auto's kv_both nodes: colocated

    for choice in reversed(solved):
        if choice.meets and share(choice.family) == share(family):
            return max(1, round(choice.cores / family.unit_cores))
    return None


def rank(choice: Choice) -> tuple:
    """Better choices first: passing, then fewer cores, then more of the requests within the SLOs."""
    return (not choice.meets, choice.cores, -choice.summary["slo_attainment"])


def row(choice: Choice, rate: float) -> dict:
    s = choice.summary
    return {"family": choice.family.name, "setup": choice.family.setup(choice.units), "nodes": choice.nodes,
            "cores": choice.cores, "meets": choice.meets, "slo_attainment": s["slo_attainment"],
            "goodput": choice.goodput(rate),
            # per one-thread node, i.e. per core (the name kept for earlier plans' JSON)
            "goodput_per_node": choice.goodput(rate) / choice.cores, "median_ttft_ms": s["median_ttft_ms"],
            "p99_ttft_ms": s["p99_ttft_ms"], "median_tpot_ms": s["median_tpot_ms"], "p99_tpot_ms": s["p99_tpot_ms"]}


def report(result: dict, profile_path: str) -> str:
    slos = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in result["slos_ms"].items())
    lines = [f"plan for {result['rate']:g} req/s, {slos}, attainment >= {result['attainment'] * 100:g} %, "
             f"at most {result['max_nodes']} cores (profile {profile_path}; {result['simulated_requests']:,} "
             f"requests simulated in {result['seconds']:.1f} s, "
             f"{result['simulated_requests'] / max(result['seconds'], 1e-9):,.0f} a second)", "",
             f"{'setup':40s} {'nodes':>5s} {'cores':>5s} {'attain':>7s} {'goodput/core':>12s} {'p50 TTFT':>9s} "
             f"{'p99 TTFT':>9s} {'p50 TPOT':>9s} {'p99 TPOT':>9s}"]
    for r in result["setups"]:
        mark = "" if r["meets"] else "  (misses the SLOs even at this size)"
        lines.append(f"{r['setup']:40s} {r['nodes']:5d} {r['cores']:5d} {r['slo_attainment'] * 100:6.1f}% "
                     f"{r['goodput_per_node']:12.3f} "
                     f"{r['median_ttft_ms']:9.0f} {r['p99_ttft_ms']:9.0f} {r['median_tpot_ms']:9.1f} "
                     f"{r['p99_tpot_ms']:9.1f}{mark}")
    for r in result.get("not_sized", []):
        lines.append(f"{r['family']:40s} more than {r['more_than_cores']} cores: not sized, a cheaper setup "
                     "passed first (--size-every-family sizes it)")
    lines.append("")
    pick = result["pick"]
    if pick:
        cores = f", {pick['cores']} cores" if pick["cores"] != pick["nodes"] else ""
        lines.append(f"cheapest: {pick['setup']} ({pick['nodes']} nodes{cores}, {pick['family']}), "
                     f"attainment {pick['slo_attainment'] * 100:.1f} %")
    else:  # a colocated node always fits (--max-nodes >= 1), so there is a closest setup
        best = max(result["setups"], key=lambda r: r["slo_attainment"])
        lines.append(f"no setup of at most {result['max_nodes']} cores meets the SLOs at {result['rate']:g} req/s: "
                     f"the closest, {best['setup']}, reaches {best['slo_attainment'] * 100:.1f} % "
                     f"(p99 TTFT {best['p99_ttft_ms']:.0f} ms, p99 TPOT {best['p99_tpot_ms']:.1f} ms)")
    return "\n".join(lines)
