"""Auto mode's shape at exactly N nodes: colocated (N kv_both nodes) or xPyD, from the profile and SLOs.

Per request, auto can only choose among the nodes it has. Over kv_both nodes every node may end
up decoding, so a later prompt stalls someone's stream; 1P1D wins under an inter-token SLO by
keeping one node free of streams, which no single request's price shows (docs/benchmarks.md,
"Sixth look"). So `pdserve up --mode auto --nodes N --slo ...` first asks the simulator which
shape of N nodes serves the workload best, then places each request within that shape:

- the candidates are the planner's colocated families and its pull units x:y that divide N
  (auto's remote prefill is a pull), each simulated as the whole N-node cluster (whole_cluster)
  with auto placing each request over it (as_auto): kv_both nodes batching as the family does, or
  its P and D nodes. Priced as static setups instead, the pick missed where auto's placement
  changes which batching pays (docs/benchmarks.md, session 55: at 64 nodes, summarize under TTFT +
  ITL, plain kv_both nodes came within the margin as static nodes and were picked; auto over them
  served 0.85 req/s at the win map's top rate, static nodes taking turns 1.36, auto over those 1.80);
- the load is the workload (`--workload`, default chat; REQUESTS of it, more for many nodes) at
  the rates given (`--rate`), or, without one, at RATE_FRACTIONS of what N idle nodes could serve
  one request at a time (light to saturating), summed over the rates;
- the best kv_both shape wins (the first in the planner's order on a tie: chunked prefill, without,
  capped) unless a P/D shape beats it by more than `margin`: kv_both nodes keep every colocated
  choice, so PD must pay for giving them up;
- a P/D winner's per-role settings are tried next (the planner's role_variants: P's token budget,
  D's most streams), one at a time; the best replaces the node's own where it gains ROLE_MARGIN.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from pdserve.plan.planner import Family, check_nodes, check_rate, families, role_variants
from pdserve.plan.profile import Profile
from pdserve.plan.sim import Setup, simulate
from pdserve.workload import BenchRequest, named_dataset

RATE_FRACTIONS = (0.25, 0.5, 1.0)
MARGIN = 0.1
ROLE_MARGIN = 0.05  # a per-role setting away from the node's own must gain this much goodput
REQUESTS = 200  # simulated per rate at least: 30 left a cell's pick to the sample (sixth look's planner map)
REQUESTS_PER_NODE = 100  # and this many a node: 200 requests over 64 nodes never load the cluster


@dataclass
class ShapePick:
    family: Family
    units: int
    rates: list[float]
    goodput: dict[str, list[float]] = field(default_factory=dict)  # setup -> auto's simulated goodput per rate

    @property
    def setup(self) -> str:
        return self.family.setup(self.units)

    @property
    def disaggregated(self) -> bool:
        return self.family.mode != "colocated"

    def describe(self) -> str:
        rows = ", ".join(f"{setup} {sum(g):.3f}" for setup, g in
                         sorted(self.goodput.items(), key=lambda kv: -sum(kv[1])))
        rates = ", ".join(f"{r:.3g}" for r in self.rates)
        return f"{self.setup} ({self.family.name}); auto's simulated goodput summed over {rates} req/s: {rows}"


def idle_rate(profile: Profile, requests: list[BenchRequest], nodes: int) -> float:
    """Requests per second that `nodes` idle nodes serve one at a time each: a load's scale."""
    chunk = profile.meta.get("node", {}).get("max_num_batched_tokens", 2048)
    seconds = statistics.mean(profile.prefill_time(r.input_len, chunk)
                              + r.output_len * profile.decode_step_time(1, r.input_len + r.output_len // 2)
                              for r in requests)
    return nodes / seconds


def candidates(profile: Profile, slos: dict[str, float], nodes: int) -> list[Family]:
    """The colocated families and pull units that make exactly `nodes` nodes."""
    return [f for f in families(profile, slos) if f.mode in ("colocated", "pull") and nodes % f.unit_nodes == 0]


def whole_cluster(family: Family, nodes: int) -> Setup:
    """The family's N-node cluster simulated whole, every node behind one proxy. (The planner's
    one-unit view with thinned arrivals misses what the proxy's choice across nodes is worth: it
    put colocated x2 at 66 % of chat's requests within TTFT + TPOT at 0.5 req/s where two nodes
    simulated whole meet 90 %, and 85 % was measured; docs/benchmarks.md, seventh look.)"""
    return family.cluster(nodes // family.unit_nodes)


def as_auto(family: Family) -> Family:
    """The shape with auto placing each request over it: its kv_both (colocated) or P and D nodes."""
    return replace(family, mode="auto")


def pick_shape(profile: Profile, requests: list[BenchRequest], slos: dict[str, float], nodes: int,
               rates: list[float] | None = None, margin: float = MARGIN, seed: int = 0) -> ShapePick:
    """The shape auto should run as at `nodes` nodes (see the module's docstring); its goodput is
    auto's over each shape."""
    check_nodes(nodes)
    for rate in rates or []:
        check_rate(rate)
    if not slos:
        raise ValueError("auto's shape is chosen for SLOs: give --slo, e.g. ttft:2000 itl:100")
    rates = rates or [f * idle_rate(profile, requests, nodes) for f in RATE_FRACTIONS]

    def goodputs(family: Family) -> list[float]:
        return [rate * simulate(profile, whole_cluster(as_auto(family), nodes), requests, rate, 1.0, seed, slos,
                                chunked_prefill=family.chunked, itls=False,
                                prefill_cap=family.prefill_cap)["slo_attainment"] for rate in rates]

    goodput = {family: goodputs(family) for family in candidates(profile, slos, nodes)}

    def top(shapes: list[Family]) -> Family | None:
        return max(shapes, key=lambda f: sum(goodput[f]), default=None)  # the first of equals: the planner's order

    best = top([f for f in goodput if f.mode == "colocated"])
    pd = top([f for f in goodput if f.mode != "colocated"])
    if best is None or (pd is not None and sum(goodput[pd]) > (1 + margin) * sum(goodput[best])):
        best = pd
    variants = role_variants(best)
    goodput.update({family: goodputs(family) for family in variants})
    tuned = max(variants, key=lambda f: sum(goodput[f]), default=best)
    if sum(goodput[tuned]) > (1 + ROLE_MARGIN) * sum(goodput[best]):
        best = tuned
    return ShapePick(best, nodes // best.unit_nodes, rates,
                     {f.setup(nodes // f.unit_nodes): g for f, g in goodput.items()})


def shape_for(profile: Profile, workload: str, slos: dict[str, float], nodes: int,
              rates: list[float] | None = None) -> ShapePick:
    """pick_shape for one of bench's named workloads (REQUESTS of it, or REQUESTS_PER_NODE a node,
    seeded): as `pdserve up --mode auto --nodes N --workload NAME` picks."""
    requests = named_dataset(workload, max(REQUESTS, REQUESTS_PER_NODE * nodes), seed=0)
    return pick_shape(profile, requests, slos, nodes, rates)
