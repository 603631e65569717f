"""The simulated proxy: its flows (colocated, pull, push, auto through the proxy's own Placer) and
policies over simulated nodes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable

import msgspec

from pdserve.config import prefill_cap_label
from pdserve.kv.params import KVTransferParams
from pdserve.plan.sim.events import Simulation
from pdserve.plan.sim.node import Job, SimNode
from pdserve.plan.sim.setup import Batching, Setup
from pdserve.plan.sim.tracker import Tracker
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.costs import CostModel
from pdserve.proxy.placement import Placer
from pdserve.proxy.policies import POLICIES, Node, select_decoder, select_prefiller
from pdserve.proxy.prefix_index import NodeCache
from pdserve.proxy.speed import DecodeWindow
from pdserve.proxy.timing import exposed_push_wait
from pdserve.workload import BenchRequest


def engine_info(batching: Batching) -> dict[str, str]:
    """What the proxy reads of a node's engine info and prices by (its prefill cap: taking turns)."""
    return {"max_prefill_tokens_while_decoding": prefill_cap_label(batching.prefill_cap)}


@dataclass
class Prompt:
    """A request as the simulated proxy sees it: its tokens (auto mode places by them) and, with
    prefix caching, the hashes of its full blocks, prompt then answer (what a node's cache files)."""

    token_ids: list[int] | None
    hashes: list[int] | None


class SimIndex:
    """The proxy's PrefixIndex over simulated nodes: each copy is the node's own cache, always in
    sync (a real proxy lags the nodes by the events of a step or two)."""

    def __init__(self, nodes: dict[str, SimNode], block_size: int) -> None:
        self.caches = {url: NodeCache(block_size=block_size, hashes=node.cached, synced=True)
                       for url, node in nodes.items() if node.cached is not None}

    def cache(self, node: Node) -> NodeCache | None:
        return self.caches.get(node.url)


class SimProxy:
    """The proxy's flows over simulated nodes, with its own policy objects and Node records
    (pdserve/proxy/policies.py): each node's in-flight requests and tokens counted from when the
    proxy asks it to when it answers, its KV usage read live (a real proxy scrapes /metrics)."""

    def __init__(self, sim: Simulation, setup: Setup, policy: str, transport: str, batching: Batching,
                 prefix_caching: bool = False, placement: str = "cost", slos: dict[str, float] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
        node = sim.profile.meta["node"]
        if transport not in sim.profile.transfer:
            raise ValueError(f"--kv-transport {transport!r}: the profile measured {sorted(sim.profile.transfer)}")
        self.sim, self.setup, self.transport = sim, setup, transport
        self.kv_bytes_per_token, self.num_layers = node["kv_bytes_per_token"], node["num_layers"]
        fit = dict(zip(sim.profile.transfer[transport].features, sim.profile.transfer[transport].coefficients))
        self._transfer_latency, self._transfer_per_byte = fit["one"], fit["bytes"]  # the hot path's copy of the fit
        self._pull_handoff = sim.profile.serving.get("pull_handoff_s", 0.0)  # side channel, D's loader

        # auto:N: kv_both nodes (each prefills, decodes, or both per request), as `pdserve up --mode auto --nodes N`
        d_role = "decode" if setup.prefill else "kv_both" if setup.mode == "auto" else "both"
        p_costs = sim.costs_for(setup.prefill_threads, "--prefill-threads")
        d_costs = sim.costs_for(setup.decode_threads, "--decode-threads")
        self.prefillers = [SimNode(sim, f"P{i}", batching.for_role(setup, "prefill"), prefix_caching, "prefill",
                                   p_costs) for i in range(setup.prefill)]
        self.decoders = [SimNode(sim, f"D{i}" if setup.prefill else f"N{i}", batching.for_role(setup, "decode"),
                                 prefix_caching, d_role, d_costs) for i in range(setup.decode)]
        self.members = {n.name: n for n in self.prefillers + self.decoders}
        self.p_nodes = [Node(n.name, "prefill", engine=engine_info(n.batching)) for n in self.prefillers]
        self.d_nodes = [Node(n.name, d_role, engine=engine_info(n.batching)) for n in self.decoders]
        if d_role == "kv_both":  # the same nodes may prefill for one another
            self.p_nodes = self.d_nodes
        self.prefill_policy, self.decode_policy = POLICIES.get(policy)(), POLICIES.get(policy)()
        if setup.mode == "auto":  # the proxy's own Placer, on the simulation's clock and nodes
            costs = replace(CostModel.of(asdict(sim.profile)), chunk_size=batching.budget)
            self.placer = Placer(costs, SimIndex(self.members, batching.block_size), placement, transport=transport,
                                 slos=slos, clock=lambda: sim.now, policy=policy)
            self.placements = {"local": 0, "remote": 0}
            self._polled = -float("inf")  # when the health poller last read the nodes' decode counters

    def _read_kv_usage(self) -> None:
        """What the proxy reads from each node's /metrics (here: live)."""
        for n in self.p_nodes + self.d_nodes:
            sim_node = self.members[n.url]
            n.kv_usage = 1.0 - sim_node.free_blocks / sim_node.batching.num_blocks

    def _poll_speeds(self) -> None:
        """What the proxy's health poller reads every interval: each node's decode-step counters,
        which its NodeSpeed holds against the profile's model (a simulated step runs the co-run and
        relay factors, which auto's prices do not: without it the simulated proxy priced steps
        those factors too cheap, and auto won in the simulator where it lost on real nodes)."""
        now = self.sim.now
        if now - self._polled < ProxyConfig.health_interval_s:
            return
        self._polled = now
        for n in self.p_nodes + self.d_nodes:
            d = self.members[n.url].decode
            n.speed.count_decode_steps(DecodeWindow(d.steps, d.seconds, d.seqs, d.kv_tokens))

    def _select(self, role: str, tokens: int) -> Node:
        self._read_kv_usage()
        if role == "prefill":
            return select_prefiller(self.p_nodes, self.prefill_policy, tokens)
        return select_decoder(self.d_nodes, self.decode_policy, tokens)

    def _ask(self, node: Node, job: Job, load: int) -> None:
        """The proxy sends `job` to `node` (one HTTP hop); the node counts as loaded until it answers."""
        node.begin(load)
        done = job.on_done

        def answered(t: float) -> None:
            node.end(load)
            done(t)

        job.on_done = answered
        sim_node = self.members[node.url]
        self.sim.at(self.sim.now + self.sim.costs.request_hop, lambda: sim_node.submit(job))

    def arrive(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt,
               on_done: Callable[[float], None]) -> None:
        """Route one request as the proxy's flow for the setup's mode does (pdserve/proxy/flows/);
        each HTTP hop to a node costs the profile's serving request_s. `on_done(t)`: its last
        token left the decode node at t."""
        load = req.input_len + req.output_len
        if self.setup.mode == "auto":
            self._place(rid, req, tracker, prompt, load, on_done)
        elif self.setup.mode == "colocated":
            self._ask(self._select("decode", load), self._answer_job(rid, req, tracker, prompt, on_done), load)
        elif self.setup.mode == "pull":
            self._pull(rid, req, tracker, prompt, self._select("prefill", load), None, load, on_done)
        else:
            self._push(rid, req, tracker, prompt, load, on_done)

    @staticmethod
    def _answer_job(rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt, on_done: Callable[[float], None],
                    kv_params: KVTransferParams | None = None) -> Job:
        """The request as the node that answers the client gets it; once done, its stages as the
        proxy's headers split them (proxy/timing.py)."""
        job = Job(rid, req.input_len, req.output_len, tracker, on_done, prompt.hashes, kv_params)

        def done(t: float) -> None:
            answered_stages(tracker, job)
            on_done(t)

        job.on_done = done
        return job

    def _pull(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt, prefiller: Node,
              decoder: Node | None, load: int, on_done: Callable[[float], None]) -> None:
        """PullFlow: P prefills and holds the KV; with P's answer the proxy sends the request to D
        (picked then, unless given), whose connector reserves blocks for what its own cache lacks
        and pulls it; P frees its blocks once pulled."""
        p_node = self.members[prefiller.url]
        prefill_job = Job(rid, req.input_len, 1, None, lambda t: None, prompt.hashes, KVTransferParams.pull_prefill())

        def prefilled(t: float) -> None:
            prefill_stages(tracker, prefill_job, t)
            if decoder is not None:  # placed at arrival: from here its load counts as asked
                decoder.unreserve(load)
            target = decoder or self._select("decode", load)
            decoder_job = self._answer_job(rid, req, tracker, prompt, on_done, prefill_job.answer_params)

            def reserved(remote_tokens: int, _: KVTransferParams | None) -> None:
                pulled = self.sim.now + self.transfer_time(remote_tokens * self.kv_bytes_per_token) + self._pull_handoff
                d_node = self.members[target.url]
                self.sim.at(pulled, lambda: (p_node.release(prefill_job), d_node.kv_arrived(decoder_job)))

            decoder_job.on_reserved = reserved
            self._ask(target, decoder_job, load)

        prefill_job.on_done = prefilled
        self._ask(prefiller, prefill_job, load)

    def _push(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt, load: int,
              on_done: Callable[[float], None]) -> None:
        """PushFlow: D first; once its connector has reserved the blocks, D announces them to the
        proxy (an HTTP hop), which sends the prompt to P; P pushes each layer as it is computed, so
        only the last layer's transfer follows the prefill."""
        decoder = self._select("decode", load)
        # The simulated requests are greedy, one sequence: D asks for P's first token (as the
        # engine's check_request would) and P pushes the whole prompt.
        d_params = msgspec.structs.replace(KVTransferParams.push_decode("sim", str(rid)), send_first_token=True)
        decoder_job = self._answer_job(rid, req, tracker, prompt, on_done, d_params)
        d_node, hop = self.members[decoder.url], self.sim.costs.request_hop

        def reserved(remote_tokens: int, announcement: KVTransferParams | None) -> None:
            last_layer = self.transfer_time(remote_tokens * self.kv_bytes_per_token / self.num_layers)

            def announced() -> None:
                prefill_job = Job(rid, req.input_len, 1, None, lambda t: pushed(prefill_job, t), prompt.hashes,
                                  KVTransferParams.push_prefill(announcement))
                self._ask(self._select("prefill", load), prefill_job, load)

            def pushed(prefill_job: Job, t: float) -> None:
                prefill_stages(tracker, prefill_job, t)
                self.sim.at(t + last_layer, lambda: d_node.kv_arrived(decoder_job))

            self.sim.at(self.sim.now + hop, announced)

        decoder_job.on_reserved = reserved
        self._ask(decoder, decoder_job, load)

    def _place(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt, load: int,
               on_done: Callable[[float], None]) -> None:
        """AutoFlow: the proxy's Placer chooses (placement.py): prefill on D, or on a P that D pulls from."""
        self._read_kv_usage()
        self._poll_speeds()
        # The simulated requests are greedy, one sequence: D decodes from P's first token
        placement = self.placer.place(prompt.token_ids, self.p_nodes, self.d_nodes, req.output_len, first_token_given=True)
        stream, decoder = self.placer.dispatched(placement), placement.decoder
        self.placements[placement.choice] += 1

        def first_token(t: float) -> None:  # as the proxy's relay marks it
            stream.first_token_at = t

        def ended(t: float, done: Callable[[float], None] = on_done) -> None:
            decoder.drop(stream)
            done(t)

        tracker.on_first, on_done = first_token, ended
        itl_slo = self.placer.slos.get("max_itl_ms")
        if itl_slo is not None:  # as the proxy's relay counts a stream whose gap passed the ITL SLO
            tracker.limit = itl_slo / 1e3

            def past_limit() -> None:
                decoder.streams_past_itl += 1

            def finished(t: float, done: Callable[[float], None] = on_done) -> None:
                decoder.streams_past_itl -= tracker.past_limit
                done(t)

            tracker.on_past_limit, on_done = past_limit, finished
        if placement.prefiller is None:
            self._ask(placement.decoder, self._answer_job(rid, req, tracker, prompt, on_done), load)
        else:
            placement.decoder.reserve(load)  # in its batch to come while P prefills (as AutoFlow does)
            self._pull(rid, req, tracker, prompt, placement.prefiller, placement.decoder, load, on_done)

    def transfer_time(self, nbytes: float) -> float:
        return max(self._transfer_latency + self._transfer_per_byte * int(nbytes), 0.0)


def prefill_stages(tracker: Tracker, prefill_job: Job, answered: float) -> None:
    """P answered at `answered`: its queue, the prefill after it as the proxy times it (from the
    client's arrival, the hop to P included) and, of that, P's engine's own."""
    queue = prefill_job.metrics.queue_seconds
    tracker.stages.update({"queue": queue * 1e3, "prefill": max(answered - tracker.arrival - queue, 0.0) * 1e3,
                           "prefill-engine": max((prefill_job.metrics.ttft or 0.0) - queue, 0.0) * 1e3})


def answered_stages(tracker: Tracker, job: Job) -> None:
    """The answering node is done: one node that did it all gives its queue, prefill (its TTFT after
    the queue) and KV wait; a D adds its queue, the KV wait that showed (push: only what passed P's
    answer) and its engine's TTFT, as the proxy's headers do (proxy/timing.py, flows/)."""
    m = job.metrics
    queue = m.queue_seconds
    if "prefill" not in tracker.stages:
        tracker.stages.update({"queue": queue * 1e3, "prefill": max((m.ttft or 0.0) - queue, 0.0) * 1e3,
                               "kv-load": m.kv_load_seconds * 1e3})
        return
    kv_ms = m.kv_load_seconds * 1e3
    if job.kv_params is not None and job.kv_params.is_push:
        kv_ms = exposed_push_wait(kv_ms, tracker.stages["queue"] + tracker.stages["prefill"])
    else:  # pull: the proxy asked D as soon as P answered
        tracker.stages["handoff"] = 0.0
    tracker.stages.update({"decode-queue": queue * 1e3, "kv-load": kv_ms, "decode-ttft": (m.ttft or 0.0) * 1e3})
