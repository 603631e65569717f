"""simulate(): a workload's arrivals and conversations through the simulated proxy and nodes,
summarized as `pdserve bench --out` summarizes a measured run."""

from __future__ import annotations

import gc
import random
from dataclasses import replace

from pdserve.kv.prefix_hash import block_hashes
from pdserve.plan.profile import Profile
from pdserve.plan.sim.events import Simulation
from pdserve.plan.sim.proxy import Prompt, SimProxy
from pdserve.plan.sim.setup import Batching, Setup
from pdserve.plan.sim.tracker import GapJitter, Tracker
from pdserve.proxy.slo import meets
from pdserve.workload import BenchRequest, arrival_gaps, conversations, summarize


def prompts_of(requests: list[BenchRequest], seed: int) -> list[list[int]]:
    """Token ids for every request (text prompts, which the simulator does not tokenize, get seeded
    ones of their length), each conversation turn after its history: the previous turn's prompt
    and an answer of seeded tokens."""
    out: list[list[int]] = []
    history: dict[int, list[int]] = {}
    for rid, req in enumerate(requests):
        rng = random.Random(seed * 1_000_003 + rid)
        ids = list(req.prompt) if isinstance(req.prompt, list) else [rng.randrange(1000, 40000)
                                                                     for _ in range(req.input_len)]
        if req.conversation is not None:
            ids = history.get(req.conversation, []) + ids
            history[req.conversation] = ids + [rng.randrange(1000, 40000) for _ in range(req.output_len)]
        out.append(ids)
    return out


class GaveUp(Exception):
    """The run cannot reach the attainment asked for any more (simulate's give_up_below)."""

    def __init__(self, at_most: float, arrived: int) -> None:
        super().__init__(f"SLO attainment at most {at_most:.3f} after {arrived} arrivals")
        self.at_most, self.arrived = at_most, arrived


class SLOWatch:
    """Requests known to miss the SLOs while the run goes on: at its TTFT deadline a request
    without a first token within it, and at its last token one that misses any SLO (meets(), as
    summarize counts). They bound the run's attainment from above, so an overloaded run stops as
    soon as it cannot reach the target (attainment = good / total >= target)."""

    def __init__(self, sim: Simulation, slos: dict[str, float], total: int, target: float) -> None:
        self.sim, self.slos, self.total, self.target = sim, slos, total, target
        self.ttft_s = slos["ttft_ms"] / 1e3 if "ttft_ms" in slos else None
        self.missed: set[int] = set()  # id() of their trackers
        self.arrived = 0

    def watch(self, tracker: Tracker) -> None:
        self.arrived += 1
        if self.ttft_s is not None:
            self.sim.at(tracker.arrival + self.ttft_s, lambda: self._check_ttft(tracker))

    def _check_ttft(self, tracker: Tracker) -> None:
        if tracker.first is None or tracker.first + self.sim.costs.stream_delay - tracker.arrival > self.ttft_s:
            self._miss(tracker)

    def finished(self, tracker: Tracker) -> None:
        if not meets(tracker.result(False, self.sim.costs.stream_delay), self.slos):
            self._miss(tracker)

    def _miss(self, tracker: Tracker) -> None:
        self.missed.add(id(tracker))
        at_most = (self.total - len(self.missed)) / self.total
        if at_most < self.target:
            raise GaveUp(at_most, self.arrived)


def simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
             seed: int, slos: dict[str, float], policy: str = "round_robin", transport: str = "shm",
             max_num_batched_tokens: int | None = None, chunked_prefill: bool = True, itls: bool = True,
             prefix_caching: bool | None = None, placement: str = "cost", give_up_below: float | None = None,
             prefill_cap: int | None = None, one_host: bool = False,
             thread_profiles: dict[int, Profile] | None = None) -> dict:
    """The summary `pdserve bench` would write for this workload on this setup (pdserve/workload.py).
    Every node runs the profiled node's settings, with the token budget and chunking given here;
    itls=False leaves the per-token gaps out (the planner reads TTFT and TPOT only).

    Conversations (`--dataset multiturn`) run as bench runs them: they arrive at the rate, each
    turn after the previous answer and its think time, its prompt the history so far. Prefix
    caching (as the nodes run by default) is modelled when asked, and by default only when the
    workload has conversations or the setup places by prefix (auto): random prompts share no
    blocks, and hashing them costs the million-request runs time for nothing.
    `placement`: auto mode's rule (`pdserve proxy --placement`), with the SLOs given.
    `prefill_cap`: every node's --max-prefill-tokens-while-decoding.
    `one_host`: every node on its own core of one host, as `pdserve up` starts them: a step runs the
    profile's co-run factors slower while another node computes (Profile.corun).
    `thread_profiles`: threads -> a profile measured at that many, for the setup's P or D nodes of
    more threads than `profile`'s (Setup.prefill_threads, decode_threads).

    `give_up_below`: stop once the SLO attainment cannot reach it (SLOWatch: more requests than it
    allows are past their TTFT deadline without a first token, or finished and missing an SLO) and
    return only `slo_attainment` (an upper bound), `gave_up` and `simulated_requests`: the
    planner's bisection needs no more of a setup that fails, and an overloaded one costs the most
    to simulate."""
    collecting = gc.isenabled()
    gc.disable()  # a run makes millions of short-lived objects and no cycles: the collector's passes are pure cost
    try:
        return _simulate(profile, setup, requests, rate, burstiness, seed, slos, policy, transport,
                         max_num_batched_tokens, chunked_prefill, itls, prefix_caching, placement, give_up_below,
                         prefill_cap, one_host, thread_profiles)
    except GaveUp as stop:
        return {"slo_attainment": stop.at_most, "gave_up": True, "simulated_requests": stop.arrived}
    finally:
        if collecting:
            gc.enable()


def _simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
              seed: int, slos: dict[str, float], policy: str, transport: str, max_num_batched_tokens: int | None,
              chunked_prefill: bool, itls: bool, prefix_caching: bool | None, placement: str,
              give_up_below: float | None, prefill_cap: int | None, one_host: bool,
              thread_profiles: dict[int, Profile] | None) -> dict:
    turns = any(req.conversation is not None for req in requests)
    caching = prefix_caching if prefix_caching is not None else setup.mode == "auto" or turns
    sim = Simulation(profile, one_host, thread_profiles)
    batching = Batching.of(profile.meta["node"], max_num_batched_tokens, chunked_prefill, prefill_cap)
    proxy = SimProxy(sim, setup, policy, transport, batching, caching, placement, slos)
    size = batching.block_size
    ids = prompts_of(requests, seed) if caching or turns or setup.mode == "auto" else [None] * len(requests)
    trackers: list[Tracker] = [None] * len(requests)  # type: ignore[list-item]
    watch = SLOWatch(sim, slos, len(requests), give_up_below) if give_up_below is not None and slos else None
    jitter = GapJitter(sim.costs.gap_excess, random.Random(seed)) if sim.costs.gap_excess else None

    def arrive(rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt, done) -> None:
        if watch is not None:
            watch.watch(tracker)
        proxy.arrive(rid, req, tracker, prompt, done)

    def send(rid: int, at: float, then: list[int]) -> None:
        """Request `rid` leaves the client at `at`; `then`: the rest of its conversation, in order."""
        req = requests[rid]
        token_ids = ids[rid]
        if token_ids is not None and len(token_ids) != req.input_len:  # a turn: the history goes first
            req = replace(req, input_len=len(token_ids))
        follows = then and requests[then[0]].conversation is not None
        answer = ids[then[0]][len(token_ids):len(token_ids) + req.output_len] if follows else []
        hashes = block_hashes(token_ids + answer, size) if caching else None
        tracker = trackers[rid] = Tracker(req, at, [] if itls else None, jitter=jitter)

        def done(t: float) -> None:
            if watch is not None:
                watch.finished(tracker)
            if then:  # the user reads the answer, thinks, and sends the next turn
                nxt = then[0]
                client_done = t + sim.costs.stream_delay
                sim.at(client_done + requests[nxt].think_s, lambda: send(nxt, sim.now, then[1:]))

        sim.at(at, lambda: arrive(rid, req, tracker, Prompt(token_ids, hashes), done))

    rids = {id(req): rid for rid, req in enumerate(requests)}
    sessions = [[rids[id(req)] for req in session] for session in conversations(requests)]
    t = 0.0
    for session, gap in zip(sessions, arrival_gaps(len(sessions), rate, burstiness, seed)):
        t += gap
        send(session[0], t, session[1:])
    sim.run()
    results = [tr.result(itls, sim.costs.stream_delay) for tr in trackers]
    duration = max((tr.last for tr in trackers if tr.first is not None), default=0.0)
    summary = summarize(results, duration, slos)
    shape = f"{setup.prefill}P{setup.decode}D" if setup.prefill else f"{setup.decode}"
    summary.update({"setup": f"{setup.mode}:{shape}", "policy": policy, "simulated": True,
                    "max_num_batched_tokens": batching.budget, "chunked_prefill": chunked_prefill,
                    "max_prefill_tokens_while_decoding": prefill_cap,
                    "prefill_max_num_batched_tokens": setup.prefill_budget,
                    "decode_max_num_seqs": setup.decode_max_seqs,
                    "prefill_threads": setup.prefill_threads, "decode_threads": setup.decode_threads,
                    "prefix_caching": caching, "simulated_requests": len(requests),
                    "preemptions": sum(n.preemptions for n in proxy.prefillers + proxy.decoders),
                    # each node's decode-only steps, as a node's /metrics counts them (benchmarks/host_load.py)
                    "decode_counters": {n.name: n.decode.counters() for n in proxy.prefillers + proxy.decoders}})
    if setup.mode == "auto":
        summary.update({"placement": placement, "placement_counts": dict(proxy.placements),
                        # what the proxy measured each node's decode steps at, against its profile (proxy/speed.py)
                        "decode_speeds": {n.url: n.speed.decode for n in proxy.d_nodes}})
    return summary
