"""Auto mode's choice, per request: which node decodes, and whether it prefills the prompt itself
or a prefill node does (then the decode node pulls the KV).

Every option is priced from the profile (proxy/costs.py) and what the proxy knows now:
- the prompt's blocks each node already holds (proxy/prefix_index.py; a node whose copy is stale
  counts as holding nothing, so it is chosen by load alone until it resyncs);
- each node's queue of prefills it was sent (`Node.prefill_backlog_until`);
- the streams decoding on the decode node, each of which a prefill there stalls for its length.

An option's predicted TTFT is queue wait + one request hop + the uncached prefill (+ for a remote
prefill: the transfer of what D does not hold, D's second hop and its recompute of the last
prompt token). Its stall is the seconds of prefill run on the decode node times the streams it
holds. The proxy takes the option of least TTFT + stall_weight x stall: with weight 1, a second
of delay to each stream already decoding counts as much as a second of this request's TTFT.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.kv.prefix_hash import block_hashes
from pdserve.proxy.costs import CostModel
from pdserve.proxy.policies import Node, NoHealthyNode
from pdserve.proxy.prefix_index import PrefixIndex


@dataclass(frozen=True)
class Placement:
    decoder: Node
    prefiller: Node | None  # None: the decode node prefills the prompt itself
    cached_tokens: int  # of the prompt, on the node that prefills it
    prefill_s: float  # predicted seconds of prefill on that node
    ttft_s: float  # predicted time to first token, from now
    stall_s: float  # predicted delay added to the streams decoding on the decode node, summed

    @property
    def choice(self) -> str:
        return "local" if self.prefiller is None else "remote"

    def score(self, stall_weight: float) -> float:
        return self.ttft_s + stall_weight * self.stall_s


class Placer:
    def __init__(self, costs: CostModel, index: PrefixIndex, stall_weight: float = 1.0, transport: str = "shm") -> None:
        self.costs, self.index, self.stall_weight, self.transport = costs, index, stall_weight, transport

    def options(self, token_ids: list[int], prefillers: list[Node], decoders: list[Node]) -> list[Placement]:
        now, costs, n = time.monotonic(), self.costs, len(token_ids)
        hop = costs.request_hop_s
        hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes

        def cached(node: Node) -> int:
            copy = self.index.cache(node)
            if copy is None or not copy.synced or not copy.block_size:
                return 0
            size = copy.block_size
            if size not in hashes:
                hashes[size] = block_hashes(token_ids, size)
            return min(copy.cached_blocks(hashes[size]) * size, n - 1)  # one token is always computed

        def wait(node: Node) -> float:
            return max(node.prefill_backlog_until - now, 0.0)

        best_p: tuple[float, Node, int, float] | None = None  # (TTFT, node, cached, prefill s): which D decodes does not change it
        for p in prefillers:
            hit = cached(p)
            seconds = costs.prefill_s(n, hit)
            ttft = wait(p) + hop + seconds
            if best_p is None or ttft < best_p[0]:
                best_p = (ttft, p, hit, seconds)
        options = []
        for d in decoders:
            hit = cached(d)
            seconds = costs.prefill_s(n, hit)
            options.append(Placement(d, None, hit, seconds, wait(d) + hop + seconds, seconds * d.active_requests))
            if best_p is not None and d.role == "decode":
                p_ttft, p, p_hit, p_seconds = best_p
                last_token = costs.prefill_s(n, n - 1)  # D computes the last prompt token itself
                ttft = p_ttft + costs.transfer_s(n - hit, self.transport) + hop + wait(d) + last_token
                options.append(Placement(d, p, p_hit, p_seconds, ttft, last_token * d.active_requests))
        return options

    def place(self, token_ids: list[int], prefillers: list[Node], decoders: list[Node]) -> Placement:
        """The cheapest option over healthy nodes; NoHealthyNode if no node can decode."""
        prefillers = [p for p in prefillers if p.healthy]
        decoders = [d for d in decoders if d.healthy]
        if not decoders:
            raise NoHealthyNode("no healthy decode or colocated node")
        options = self.options(token_ids, prefillers, decoders)
        return min(options, key=lambda o: (o.score(self.stall_weight), o.decoder.active_requests))

    @staticmethod
    def dispatched(placement: Placement) -> None:
        """Queue the prefill's predicted time on the node that runs it."""
        node = placement.prefiller or placement.decoder
        node.prefill_backlog_until = max(node.prefill_backlog_until, time.monotonic()) + placement.prefill_s
