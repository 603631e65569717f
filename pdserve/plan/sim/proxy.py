"""The simulated proxy: its flows (colocated, pull, push, auto through the proxy's own Placer) and
policies over simulated nodes."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import Callable

from pdserve.plan.sim.events import Simulation
from pdserve.plan.sim.node import Job, SimNode
from pdserve.plan.sim.setup import POLICIES, Batching, Setup
from pdserve.plan.sim.tracker import Tracker
from pdserve.proxy.costs import CostModel
from pdserve.proxy.placement import Placer
from pdserve.proxy.policies import Node
from pdserve.proxy.prefix_index import NodeCache
from pdserve.workload import BenchRequest


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
    def __init__(self, sim: Simulation, setup: Setup, policy: str, transport: str, batching: Batching,
                 prefix_caching: bool = False, placement: str = "cost", slos: dict[str, float] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
        node = sim.profile.meta["node"]
        if transport not in sim.profile.transfer:
            raise ValueError(f"--kv-transport {transport!r}: the profile measured {sorted(sim.profile.transfer)}")
        self.sim, self.setup, self.policy, self.transport = sim, setup, policy, transport
        self.kv_bytes_per_token, self.num_layers = node["kv_bytes_per_token"], node["num_layers"]
        fit = dict(zip(sim.profile.transfer[transport].features, sim.profile.transfer[transport].coefficients))
        self._transfer_latency, self._transfer_per_byte = fit["one"], fit["bytes"]  # the hot path's copy of the fit

        self.prefillers = [SimNode(sim, f"P{i}", batching, prefix_caching=prefix_caching)
                           for i in range(setup.prefill)]
        self.decoders = [SimNode(sim, f"D{i}" if setup.prefill else f"N{i}", batching, prefix_caching=prefix_caching)
                         for i in range(setup.decode)]
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        if setup.mode == "auto":  # the proxy's own Placer, on the simulation's clock and nodes
            self.members = {n.name: n for n in self.prefillers + self.decoders}
            self.p_nodes = [Node(n.name, "prefill") for n in self.prefillers]
            self.d_nodes = [Node(n.name, "decode" if setup.prefill else "both") for n in self.decoders]
            costs = replace(CostModel.of(asdict(sim.profile)), chunk_size=batching.budget)
            self.placer = Placer(costs, SimIndex(self.members, batching.block_size), placement, transport=transport,
                                 slos=slos, clock=lambda: sim.now)
            self.placements = {"local": 0, "remote": 0}

    def _pick(self, nodes: list[SimNode], kind: str) -> SimNode:
        if self.policy == "least_loaded":
            return min(nodes, key=lambda n: (n.outstanding, nodes.index(n)))
        return nodes[next(self._turns[kind]) % len(nodes)]

    def arrive(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt,
               on_done: Callable[[float], None]) -> None:
        """Route one request; each HTTP hop to a node costs the profile's serving request_s.
        `on_done(t)`: its last token left the decode node at t."""
        hop, now = self.sim.costs.request_hop, self.sim.now
        if self.setup.mode == "auto":
            self._place(rid, req, tracker, prompt, on_done)
        elif self.setup.mode == "colocated":
            node = self._pick(self.decoders, "decode")
            job = Job(rid, req.input_len, 0, req.output_len, tracker, on_done, hashes=prompt.hashes)
            self.sim.at(now + hop, lambda: node.submit(job))
        elif self.setup.mode == "pull":
            self._pull(rid, req, tracker, prompt, self._pick(self.prefillers, "prefill"), None, on_done)
        else:  # push: D had the request first; only the last layer's bytes follow the prefill
            decoder = self._pick(self.decoders, "decode")
            decoder_job = Job(rid, req.input_len, req.input_len - 1, req.output_len, tracker, on_done,
                              hashes=prompt.hashes)
            nbytes = req.input_len * self.kv_bytes_per_token

            def pushed(t: float) -> None:
                self.sim.at(t + self.profile_transfer(nbytes / self.num_layers),
                            lambda: (prefiller.release(prefill_job), decoder.submit(decoder_job)))

            prefiller = self._pick(self.prefillers, "prefill")
            prefill_job = Job(rid, req.input_len, 0, 1, None, pushed, hold=True, hashes=prompt.hashes)
            self.sim.at(now + hop, lambda: prefiller.submit(prefill_job))

    def _pull(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt, prefiller: SimNode,
              decoder: SimNode | None, on_done: Callable[[float], None],
              on_prefilled: Callable[[], None] = lambda: None) -> None:
        """P prefills and holds the KV; when P answers, the proxy sends the request to D (picked
        then, unless given), which pulls what its own cache lacks; P frees the KV once pulled."""
        hop, n = self.sim.costs.request_hop, req.input_len
        decoder_job = Job(rid, n, n - 1, req.output_len, tracker, on_done, hashes=prompt.hashes)

        def prefilled(t: float) -> None:
            on_prefilled()
            target = decoder or self._pick(self.decoders, "decode")
            held = target.cached_tokens(decoder_job)
            pulled = t + self.profile_transfer((n - held) * self.kv_bytes_per_token) + hop
            self.sim.at(pulled, lambda: (prefiller.release(prefill_job), target.submit(decoder_job)))

        prefill_job = Job(rid, n, 0, 1, None, prefilled, hold=True, hashes=prompt.hashes)
        self.sim.at(self.sim.now + hop, lambda: prefiller.submit(prefill_job))

    def _place(self, rid: int, req: BenchRequest, tracker: Tracker, prompt: Prompt,
               on_done: Callable[[float], None]) -> None:
        """Auto mode: the proxy's Placer chooses (placement.py), the flow runs as AutoFlow runs it."""
        for n in self.p_nodes + self.d_nodes:  # what the proxy reads from each node's /metrics
            sim_node = self.members[n.url]
            n.kv_usage = 1.0 - sim_node.free_blocks / sim_node.batching.num_blocks
        placement = self.placer.place(prompt.token_ids, self.p_nodes, self.d_nodes, req.output_len)
        self.placer.dispatched(placement)
        self.placements[placement.choice] += 1
        d, p, load = placement.decoder, placement.prefiller, req.input_len + req.output_len

        def decoded(t: float) -> None:
            d.end(load)
            on_done(t)

        if p is None:
            d.begin(load)
            job = Job(rid, req.input_len, 0, req.output_len, tracker, decoded, hashes=prompt.hashes)
            self.sim.at(self.sim.now + self.sim.costs.request_hop, lambda: self.members[d.url].submit(job))
            return
        p.begin(load)
        self._pull(rid, req, tracker, prompt, self.members[p.url], self.members[d.url], decoded,
                   on_prefilled=lambda: (p.end(load), d.begin(load)))

    def profile_transfer(self, nbytes: float) -> float:
        return max(self._transfer_latency + self._transfer_per_byte * int(nbytes), 0.0)
