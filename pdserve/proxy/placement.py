"""Auto mode's choice, per request: which node decodes, and whether it prefills the prompt itself
or a prefill node does (then the decode node pulls the KV). kv_both nodes are both: each may
decode with its own prefill, prefill for another, or decode what another prefilled, so auto over
them has every colocated choice and more.

Every option is priced from the profile (proxy/costs.py) and what the proxy knows now:
- the prompt's blocks each node already holds (proxy/prefix_index.py; a node whose copy is stale
  counts as holding nothing, so it is chosen by load alone until it resyncs);
- each node's queue of prefills it was sent (`Node.prefill_backlog_until`);
- the streams decoding on the decode node, each of which a prefill there stalls for its length.

An option's predicted TTFT is queue wait + one request hop + the uncached prefill (+ for a remote
prefill: the transfer of what D does not hold, D's second hop, and its recompute of the last
prompt token unless D decodes from P's first token: kv_transfer_params.first_token_id). Its stall is the seconds of prefill run on the decode node times the streams it
holds (and, prefilled on a kv_both node, the prefill times the streams that node holds). A node
whose prefill and decode take turns (--max-prefill-tokens-while-decoding 0) stalls no stream: a
prompt there waits instead until the streams under way have finished, and decodes in the next turn,
beside the prompts that wait with it (turn_ends, next_turn: from what the proxy sees of the requests
placed there, Node.streams, each streaming since its first token was relayed or still waiting),
and that wait is in the TTFT. The
proxy takes the option of least TTFT + stall_weight x stall: with weight 1, a second of delay to
each stream already decoding counts as much as a second of this request's TTFT.
Given SLOs (`--slo ttft:MS tpot:MS`), it first takes the options that make the fewest requests
miss them (Placer.misses): under a loose TTFT and a tight TPOT SLO, queueing behind a long
prefill is cheaper than a decode batch one stream too big. Under an ITL SLO a stream whose gap the
proxy already saw pass it (Node.streams_past_itl, counted as it relays the stream) cannot miss it
again, so a prefill beside such streams costs nothing there: prompts gather on the node whose
streams are already late and leave the others' gaps short. Where every option is predicted to make
someone miss and the static route (the proxy's --policy, as colocated or xPyD would go) makes no
more miss than the best, it takes the static route: the costs then cannot tell the options apart
(under a 67 ms ITL SLO, least TTFT + stall gave longest gaps no shorter than colocated's round
robin: docs/benchmarks.md, "Third look").
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable, ClassVar

from pdserve.kv.hosts import same_host
from pdserve.kv.prefix_hash import block_hashes
from pdserve.proxy.costs import CostModel
from pdserve.proxy.policies import POLICIES, Node, NoHealthyNode, Stream
from pdserve.proxy.prefix_index import PrefixIndex
from pdserve.registry import Registry


@dataclass(frozen=True)
class Placement:
    decoder: Node
    prefiller: Node | None  # None: the decode node prefills the prompt itself
    cached_tokens: int  # of the prompt, on the node that prefills it
    prefill_s: float  # predicted seconds of prefill on that node
    prefill_profile_s: float  # the profile's prediction, before that node's measured speed (proxy/speed.py)
    ttft_s: float  # predicted time to first token, from now
    stall_s: float  # predicted delay added to the streams decoding on the decode node, summed
    # ... and on the node that prefills it remotely, when that node decodes streams too (kv_both)
    prefiller_stall_s: float = 0.0
    output_tokens: int = 0  # what the request asks for: how long it will hold the decode node (turn_ends)
    prompt_tokens: int = 0  # its prompt: KV its decode steps read (as Placer.misses prices them)

    @property
    def choice(self) -> str:
        return "local" if self.prefiller is None else "remote"

    def score(self, stall_weight: float) -> float:
        return self.ttft_s + stall_weight * (self.stall_s + self.prefiller_stall_s)


def pair_transport(decoder: Node, prefiller: Node) -> str:
    """The transport D would pull P's KV over, from their engine info: D's --kv-transport, or for
    auto (kv/transport's choose_transport, which the proxy may not import: tests/test_placement.py
    checks the two agree) shm where P serves it on D's host, else tcp. A node that reports no KV
    labels: tcp."""
    configured = decoder.engine.get("kv_transport", "auto")
    if configured != "auto":
        return configured
    d_host, p_host = decoder.engine.get("kv_host", ""), prefiller.engine.get("kv_host", "")
    serves_shm = "shm" in prefiller.engine.get("kv_transports", "").split(",")
    return "shm" if serves_shm and same_host(p_host, d_host) else "tcp"


class PromptView:
    """One prompt against the nodes now: the blocks each holds, its queue, and each option's price."""

    def __init__(self, token_ids: list[int], costs: CostModel, index: PrefixIndex, transport: str | None,
                 now: float, first_token_given: bool = False) -> None:
        self.token_ids, self.costs, self.index, self.transport = token_ids, costs, index, transport
        self.now = now
        self.first_token_given = first_token_given  # remote: D decodes from P's first token, computing no prompt token
        self._hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes
        self._cached: dict[str, int] = {}

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def cached(self, node: Node) -> int:
        """Prompt tokens the node's prefix cache holds (0 while the proxy's copy of it is stale)."""
        if node.url not in self._cached:
            copy, n = self.index.cache(node), self.tokens
            hit = 0
            if copy is not None and copy.synced and copy.block_size:
                size = copy.block_size
                if size not in self._hashes:
                    self._hashes[size] = block_hashes(self.token_ids, size)
                hit = min(copy.cached_blocks(self._hashes[size]) * size, n - 1)  # one token is always computed
            self._cached[node.url] = hit
        return self._cached[node.url]

    def wait(self, node: Node) -> float:
        """Until the node can start a prompt: its queue of prefills, and where its prefill and decode
        take turns, its turn of streams ending."""
        return max(prefill_start(node, self.now, self.costs) - self.now, 0.0)

    def load_wait(self, d: Node) -> float:
        """Until `d` takes this prompt's KV from another node. A node taking turns admits a load while
        its streams decode (it computes nothing, given P's first token), unless prompts queued before
        it wait for those streams (the queue is first come first served)."""
        if not (d.takes_turns and self.first_token_given):
            return self.wait(d)
        queued = d.prefill_backlog_until > self.now
        return max(turn_ends(d, self.now, self.costs) - self.now, 0.0) if queued and d.streams else 0.0

    def local(self, d: Node) -> Placement:
        hit = self.cached(d)
        profile_s = self.costs.prefill_s(self.tokens, hit)
        seconds = profile_s * d.speed.prefill
        return Placement(d, None, hit, seconds, profile_s, self.wait(d) + self.costs.request_hop_s + seconds,
                         seconds * streams_stalled(d))

    def prefill_ttft(self, p: Node) -> float:
        """When P would answer the proxy: its queue, a hop, the prefill of what it does not hold."""
        return (self.wait(p) + self.costs.request_hop_s
                + self.costs.prefill_s(self.tokens, self.cached(p)) * p.speed.prefill)

    def remote(self, d: Node, p: Node) -> Placement:
        n, costs, hit = self.tokens, self.costs, self.cached(p)
        # D computes the last prompt token itself, unless it decodes from P's first token
        last_token = 0.0 if self.first_token_given else costs.prefill_s(n, n - 1) * d.speed.prefill
        transport = self.transport or pair_transport(d, p)
        ttft = (self.prefill_ttft(p) + costs.transfer_s(n - self.cached(d), transport) + costs.request_hop_s
                + self.load_wait(d) + last_token)
        profile_s = costs.prefill_s(n, hit)
        seconds = profile_s * p.speed.prefill
        streams_on_p = streams_stalled(p) if p.role == "kv_both" else 0  # a P node decodes nothing
        return Placement(d, p, hit, seconds, profile_s, ttft, last_token * streams_stalled(d), seconds * streams_on_p)

    def uncached(self, node: Node) -> int:
        return self.tokens - self.cached(node)


def prefill_start(node: Node, now: float, costs: CostModel) -> float:
    """When the node can start a prompt sent now: after its queue of prefills and, where its
    prefill and decode take turns, after its turn of streams (turn_ends)."""
    start = max(node.prefill_backlog_until, now)
    return max(start, turn_ends(node, now, costs)) if node.takes_turns and node.streams else start


def turn_ends(node: Node, now: float, costs: CostModel) -> float:
    """When a node taking turns ends the turn a prompt sent now must wait for. With streams under
    way: when the last of them is out (its first token + its tokens at the step of their batch);
    the prompts waiting meanwhile are prefilled then, together, and decode in the next turn. With
    none under way but prompts placed (prefilling now): their turn, after their prefills. From what
    the proxy sees (Node.streams), not chained from predictions: a chain grew by every placement
    until the node went idle, so a node that had drained to one stream still looked busy for tens
    of seconds and its requests went to the other node, whose batches grew past the TPOT SLO."""
    streaming = node.streaming
    turn = streaming or node.streams
    if not turn:
        return now
    step = costs.step_s(len(turn), sum(s.tokens for s in turn)) * node.speed.decode
    if streaming:
        return max(max(s.first_token_at + s.output_tokens * step for s in streaming), now)
    return max(node.prefill_backlog_until, now) + max(s.output_tokens for s in turn) * step


def next_turn(node: Node) -> list[Stream]:
    """The streams a prompt placed now on a node taking turns would decode beside: the prompts
    waiting for the streams under way to end (none under way: the waiting ones decode before it)."""
    return node.waiting if node.streaming else []


def streams_stalled(node: Node) -> int:
    """The streams a prompt computed on the node now would stall: none where it takes turns."""
    return 0 if node.takes_turns else node.active_requests


def pulls(node: Node) -> bool:
    """Can decode a prompt another node prefilled (pulls its KV)."""
    return node.role in ("decode", "kv_both")


def other(prefillers: list[Node], d: Node) -> list[Node]:
    """The nodes that may prefill for `d` (a kv_both node does not prefill for itself remotely)."""
    return [p for p in prefillers if p is not d]


class PlacementRule(ABC):
    """One way to choose (`--placement NAME`): registered in PLACEMENT_RULES under its `name`. It
    gets the Placer (its costs, SLOs and settings) and returns a Placement over healthy nodes."""

    name: ClassVar[str]

    def __init__(self, placer: Placer) -> None:
        self.placer = placer

    @abstractmethod
    def place(self, view: PromptView, prefillers: list[Node], decoders: list[Node], output_tokens: int) -> Placement:
        """The choice for one prompt; `prefillers` may be empty, `decoders` is not."""


class CostRule(PlacementRule):
    """pdserve's: the option of fewest SLO misses, then least TTFT + stall_weight x stall; the static
    route (`static`) where no option is predicted to save a miss it would make."""

    name = "cost"

    def __init__(self, placer: Placer) -> None:
        super().__init__(placer)
        self.static = ByPolicy(placer, placer.policy)

    def place(self, view: PromptView, prefillers: list[Node], decoders: list[Node], output_tokens: int) -> Placement:
        placer = self.placer
        best = min(placer.options(view, prefillers, decoders),
                   key=lambda o: (placer.misses(o, view, output_tokens), o.score(placer.stall_weight),
                                  o.decoder.coming_requests))
        if not placer.slos:
            return best
        static = self.static.place(view, prefillers, decoders, output_tokens)  # its rotation moves every request
        fewest = placer.misses(best, view, output_tokens)
        return static if fewest > 0 and placer.misses(static, view, output_tokens) <= fewest else best


class ByPolicy(PlacementRule):
    """A routing policy's baseline: the decode node by the policy, prefill on a P node (by the
    policy too) whenever the decode node is a D (a kv_both node prefills itself, as colocated)."""

    policy: ClassVar[str]

    def __init__(self, placer: Placer, policy: str | None = None) -> None:
        super().__init__(placer)
        self.choosers = {kind: POLICIES.get(policy or self.policy)() for kind in ("prefill", "decode")}

    def place(self, view: PromptView, prefillers: list[Node], decoders: list[Node], output_tokens: int) -> Placement:
        d = self.choosers["decode"].choose(decoders, view.tokens)
        if d.role == "decode" and prefillers:
            return view.remote(d, self.choosers["prefill"].choose(prefillers, view.tokens))
        return view.local(d)


class RoundRobinRule(ByPolicy):
    name = policy = "round_robin"


class LeastLoadedRule(ByPolicy):
    name = policy = "least_loaded"


class ThresholdRule(PlacementRule):
    """Dynamo's: the decode node of least uncached prefill + load; prefill remotely only when the
    uncached prompt exceeds `threshold_tokens` and P's queue is short."""

    name = "threshold"
    MAX_PREFILL_QUEUE = 2  # requests on a P node past which the prefill stays local

    def place(self, view: PromptView, prefillers: list[Node], decoders: list[Node], output_tokens: int) -> Placement:
        d = min(decoders, key=lambda n: (view.uncached(n) + n.active_tokens, n.active_requests))
        p = min(other(prefillers, d), key=lambda n: (n.active_requests, view.uncached(n)), default=None)
        if (pulls(d) and p is not None and view.uncached(d) > self.placer.threshold_tokens
                and p.active_requests < self.MAX_PREFILL_QUEUE):
            return view.remote(d, p)
        return view.local(d)


class ScorersRule(PlacementRule):
    """llm-d's: prefix cache x3 + queue x2 + KV usage x2, normalized; prefill remotely when the
    uncached suffix exceeds `threshold_tokens`."""

    name = "scorers"

    def place(self, view: PromptView, prefillers: list[Node], decoders: list[Node], output_tokens: int) -> Placement:
        d = max(decoders, key=lambda n: self.score(n, decoders, view))
        candidates = other(prefillers, d)
        if pulls(d) and candidates and view.uncached(d) > self.placer.threshold_tokens:
            return view.remote(d, max(candidates, key=lambda n: self.score(n, candidates, view)))
        return view.local(d)

    @staticmethod
    def score(node: Node, nodes: list[Node], view: PromptView) -> float:
        longest_queue = max(n.active_requests for n in nodes)
        prefix = view.cached(node) / view.tokens
        queue = 1.0 - node.active_requests / longest_queue if longest_queue else 1.0
        return 3 * prefix + 2 * queue + 2 * (1.0 - node.kv_usage)


# --placement: a new rule is one PlacementRule subclass plus one entry (or PLACEMENT_RULES.register).
PLACEMENT_RULES: Registry[PlacementRule] = Registry("--placement", {
    rule.name: rule for rule in (CostRule, RoundRobinRule, LeastLoadedRule, ThresholdRule, ScorersRule)})


class Placer:
    """Prices the options (PromptView) and chooses by its rule (PLACEMENT_RULES: `cost`, pdserve's,
    or a baseline in the same code path)."""

    def __init__(self, costs: CostModel, index: PrefixIndex, rule: str = "cost", stall_weight: float = 1.0,
                 threshold_tokens: int = 512, transport: str | None = None, slos: dict[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic, policy: str = "round_robin") -> None:
        self.costs, self.index, self.transport = costs, index, transport
        self.stall_weight, self.threshold_tokens = stall_weight, threshold_tokens
        self.slos = slos or {}  # ttft_ms / tpot_ms / max_itl_ms: the cost rule first counts who would miss them
        inf = float("inf")  # the same in seconds, each inf when not set
        self.ttft_slo_s, self.tpot_slo_s, self.itl_slo_s = (self.slos.get(k, inf) / 1e3
                                                            for k in ("ttft_ms", "tpot_ms", "max_itl_ms"))
        self.policy = policy  # the static route (proxy/policies.py) the cost rule keeps where it saves no miss
        self.clock = clock  # the simulator runs this Placer on its own clock (plan/sim/)
        self.rule = PLACEMENT_RULES.get(rule)(self)

    def options(self, view: PromptView, prefillers: list[Node], decoders: list[Node]) -> list[Placement]:
        """Every decode node, prefilling locally or on the other node that would answer first."""
        ranked = sorted(prefillers, key=view.prefill_ttft)[:2]  # the first, and the next for itself
        options = []
        for d in decoders:
            options.append(view.local(d))
            p = next((p for p in ranked if p is not d), None)
            if p is not None and pulls(d):
                options.append(view.remote(d, p))
        return options

    def misses(self, option: Placement, view: PromptView, output_tokens: int) -> int:
        """Requests predicted to miss an SLO if `option` is taken: this one (its TTFT; its TPOT or
        longest gap in the decode node's batch grown by one) and the streams on the decode node
        that met the TPOT or ITL SLO before and would not after (a bigger batch, plus the stall:
        spread over their tokens for TPOT, whole in one gap for ITL; streams_missing). On a node
        taking turns a prompt it prefills joins the next turn's batch, not the streams under way."""
        if not self.slos:
            return 0
        d, costs = option.decoder, self.costs
        ttft_slo, tpot_slo, itl_slo = self.ttft_slo_s, self.tpot_slo_s, self.itl_slo_s  # ITL: a stall lands in one gap
        streams, past_itl, speed = d.active_requests, d.streams_past_itl, d.speed.decode
        coming, coming_tokens = d.coming_requests, d.active_tokens + d.reserved_tokens  # its batch, placed ones in
        if d.takes_turns and option.prefiller is None:
            turn = next_turn(d)  # none of them has streamed: none is past the ITL SLO
            streams = coming = len(turn)
            coming_tokens, past_itl = sum(s.tokens for s in turn), 0
        before = costs.step_s(coming, coming_tokens) * speed
        after = costs.step_s(coming + 1, coming_tokens + view.tokens + output_tokens) * speed
        misses = int(option.ttft_s > ttft_slo) + int(after > tpot_slo or after > itl_slo)
        stall = option.stall_s / streams if streams else 0.0  # each stream's (stall_s sums them)
        misses += self.streams_missing(streams, past_itl, before, after + stall / output_tokens, after + stall)
        p = option.prefiller
        if option.prefiller_stall_s and p is not None:  # a kv_both node's streams wait for the prefill
            step = costs.step_s(p.active_requests, p.active_tokens) * p.speed.decode
            misses += self.streams_missing(p.active_requests, p.streams_past_itl, step,
                                           step + option.prefill_s / output_tokens, step + option.prefill_s)
        return misses

    def streams_missing(self, streams: int, past_itl: int, step: float, tpot: float, longest_gap: float) -> int:
        """Of `streams` that meet the SLOs at `step`, those that would not at this `tpot` and
        `longest_gap`; for the ITL SLO only those whose gaps have all been within it so far (the
        proxy sees each stream's gaps: Node.streams_past_itl, `past_itl`)."""
        tpot_slo, itl_slo = self.tpot_slo_s, self.itl_slo_s
        if step <= tpot_slo < tpot:
            return streams
        if step <= itl_slo < longest_gap:
            return max(streams - past_itl, 0)
        return 0

    def place(self, token_ids: list[int], prefillers: list[Node], decoders: list[Node],
              output_tokens: int = 128, first_token_given: bool = False) -> Placement:
        """The rule's choice over healthy nodes; NoHealthyNode if no node can decode.
        `output_tokens`: what the request asks for (the SLO-aware cost rule spreads stalls over it);
        `first_token_given`: prefilled remotely, D would decode from P's first token
        (SamplingParams.decodes_from_given_token), not compute the last prompt token."""
        prefillers = [p for p in prefillers if p.healthy]
        decoders = [d for d in decoders if d.healthy]
        if not decoders:
            raise NoHealthyNode("no healthy decode or colocated node")
        for d in decoders:  # the decode steps each node ran since the last request
            d.speed.fold_decode(self.costs.step_s)
        view = PromptView(token_ids, self.costs, self.index, self.transport, self.clock(), first_token_given)
        return replace(self.rule.place(view, prefillers, decoders, output_tokens), output_tokens=output_tokens,
                       prompt_tokens=view.tokens)

    def dispatched(self, placement: Placement) -> Stream:
        """Queue the prefill's predicted time on the node that runs it, and the request on its decode
        node: the Stream the flow marks at its first token and ends with it (Node.end)."""
        now, node, d = self.clock(), placement.prefiller or placement.decoder, placement.decoder
        node.prefill_backlog_until = prefill_start(node, now, self.costs) + placement.prefill_s
        stream = Stream(placement.prompt_tokens, placement.output_tokens)
        d.streams.append(stream)
        return stream
