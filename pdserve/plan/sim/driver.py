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
from pdserve.plan.sim.tracker import Tracker
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


def simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
             seed: int, slos: dict[str, float], policy: str = "round_robin", transport: str = "shm",
             max_num_batched_tokens: int | None = None, chunked_prefill: bool = True, itls: bool = True,
             prefix_caching: bool | None = None, placement: str = "cost") -> dict:
    """The summary `pdserve bench` would write for this workload on this setup (pdserve/workload.py).
    Every node runs the profiled node's settings, with the token budget and chunking given here;
    itls=False leaves the per-token gaps out (the planner reads TTFT and TPOT only).

    Conversations (`--dataset multiturn`) run as bench runs them: they arrive at the rate, each
    turn after the previous answer and its think time, its prompt the history so far. Prefix
    caching (as the nodes run by default) is modelled when asked, and by default only when the
    workload has conversations or the setup places by prefix (auto): random prompts share no
    blocks, and hashing them costs the million-request runs time for nothing.
    `placement`: auto mode's rule (`pdserve proxy --placement`), with the SLOs given."""
    collecting = gc.isenabled()
    gc.disable()  # a run makes millions of short-lived objects and no cycles: the collector's passes are pure cost
    try:
        return _simulate(profile, setup, requests, rate, burstiness, seed, slos, policy, transport,
                         max_num_batched_tokens, chunked_prefill, itls, prefix_caching, placement)
    finally:
        if collecting:
            gc.enable()


def _simulate(profile: Profile, setup: Setup, requests: list[BenchRequest], rate: float, burstiness: float,
              seed: int, slos: dict[str, float], policy: str, transport: str, max_num_batched_tokens: int | None,
              chunked_prefill: bool, itls: bool, prefix_caching: bool | None, placement: str) -> dict:
    turns = any(req.conversation is not None for req in requests)
    caching = prefix_caching if prefix_caching is not None else setup.mode == "auto" or turns
    sim = Simulation(profile)
    batching = Batching.of(profile.meta["node"], max_num_batched_tokens, chunked_prefill)
    proxy = SimProxy(sim, setup, policy, transport, batching, caching, placement, slos)
    size = batching.block_size
    ids = prompts_of(requests, seed) if caching or turns or setup.mode == "auto" else [None] * len(requests)
    trackers: list[Tracker] = [None] * len(requests)  # type: ignore[list-item]

    def send(rid: int, at: float, then: list[int]) -> None:
        """Request `rid` leaves the client at `at`; `then`: the rest of its conversation, in order."""
        req = requests[rid]
        token_ids = ids[rid]
        if token_ids is not None and len(token_ids) != req.input_len:  # a turn: the history goes first
            req = replace(req, input_len=len(token_ids))
        follows = then and requests[then[0]].conversation is not None
        answer = ids[then[0]][len(token_ids):len(token_ids) + req.output_len] if follows else []
        hashes = block_hashes(token_ids + answer, size) if caching else None
        tracker = trackers[rid] = Tracker(req, at, [] if itls else None)

        def done(t: float) -> None:
            if then:  # the user reads the answer, thinks, and sends the next turn
                nxt = then[0]
                client_done = t + sim.costs.stream_delay
                sim.at(client_done + requests[nxt].think_s, lambda: send(nxt, sim.now, then[1:]))

        sim.at(at, lambda: proxy.arrive(rid, req, tracker, Prompt(token_ids, hashes), done))

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
                    "prefix_caching": caching,
                    "preemptions": sum(n.preemptions for n in proxy.prefillers + proxy.decoders)})
    if setup.mode == "auto":
        summary.update({"placement": placement, "placement_counts": dict(proxy.placements)})
    return summary
