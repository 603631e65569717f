"""Choosing nodes: `select_prefiller` and `select_decoder`, by round robin or by load."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.config import prefill_cap_label
from pdserve.proxy.cluster import NodeLoad
from pdserve.proxy.speed import NodeSpeed
from pdserve.registry import Registry


@dataclass(eq=False)
class Stream:
    """A request auto mode placed on a decode node, from its placement to its end: what a node
    taking turns is priced by (proxy/placement.py, turn_ends). Not yet streaming, it waits for the
    node's next turn; streaming, it holds the node's turn until its tokens are out."""

    prompt_tokens: int
    output_tokens: int
    first_token_at: float | None = None  # when the proxy relayed its first token (time.monotonic)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass
class Node:
    url: str
    role: str  # "prefill" | "decode" | "both" | "kv_both"
    healthy: bool = True
    active_requests: int = 0
    active_tokens: int = 0  # estimated prompt + generation tokens of requests in flight
    kv_usage: float = 0.0  # fraction of the node's KV blocks in use (from its /metrics)
    served: int = 0
    failures: int = 0  # consecutive failed health checks
    engine: dict[str, str] = field(default_factory=dict)  # device, isa, dtype, kernels (its engine_info)
    prefill_backlog_until: float = 0.0  # auto mode: when the prefills sent to it are predicted done (monotonic s)
    speed: NodeSpeed = field(default_factory=NodeSpeed)  # auto mode: how fast it runs against the profile
    # auto mode under an ITL SLO: streams on it whose longest gap so far passed the SLO (a stall there
    # cannot make them miss it again)
    streams_past_itl: int = 0
    # auto mode: requests placed here to decode that are still prefilling on another node: not yet
    # streams (no stall of theirs), but they join its batch, and a choice blind to them sends every
    # request placed while they prefill to the same decode node
    reserved_requests: int = 0
    reserved_tokens: int = 0
    # auto mode: the requests placed here to decode, from placement to their end (a node whose
    # prefill and decode take turns starts no prompt while any of them streams)
    streams: list[Stream] = field(default_factory=list)
    load: NodeLoad | None = None  # its latest metrics, for the dashboard (proxy/cluster.py)

    @property
    def takes_turns(self) -> bool:
        """Its prefill and decode take turns: no prompt token while a stream decodes
        (--max-prefill-tokens-while-decoding 0, as its engine info reports)."""
        return self.engine.get("max_prefill_tokens_while_decoding") == prefill_cap_label(0)

    def reserve(self, tokens: int) -> None:
        self.reserved_requests += 1
        self.reserved_tokens += tokens

    def unreserve(self, tokens: int) -> None:
        self.reserved_requests -= 1
        self.reserved_tokens -= tokens

    @property
    def coming_requests(self) -> int:
        """Its streams once the requests placed here have arrived."""
        return self.active_requests + self.reserved_requests

    @property
    def streaming(self) -> list[Stream]:
        """Its streams whose first token the proxy has relayed."""
        return [s for s in self.streams if s.first_token_at is not None]

    @property
    def waiting(self) -> list[Stream]:
        """Its streams not yet streaming: queued, prefilling, or their KV on its way."""
        return [s for s in self.streams if s.first_token_at is None]

    def drop(self, stream: Stream) -> None:
        """The request no longer holds a turn here (ended, or never reached the node)."""
        if stream in self.streams:
            self.streams.remove(stream)

    def record_check(self, ok: bool, max_failures: int) -> None:
        """Leave rotation after `max_failures` failed checks in a row; come back on the first success."""
        self.failures = 0 if ok else self.failures + 1
        self.healthy = ok or (self.healthy and self.failures < max_failures)

    def begin(self, tokens: int) -> None:
        self.active_requests += 1
        self.active_tokens += tokens

    def end(self, tokens: int, ok: bool = True, stream: Stream | None = None) -> None:
        self.active_requests -= 1
        self.active_tokens -= tokens
        self.served += ok
        if stream is not None:  # a request's end on its decode node
            self.drop(stream)
        if self.active_requests == 0:  # idle: whatever was predicted is done
            self.prefill_backlog_until = 0.0


class Policy(Protocol):
    """Chooses one of the healthy nodes of a role for a request of about `tokens` tokens."""

    def choose(self, nodes: list[Node], tokens: int) -> Node: ...


@dataclass
class RoundRobin:
    _counter: itertools.count = field(default_factory=itertools.count)

    def choose(self, nodes: list[Node], tokens: int) -> Node:
        return nodes[next(self._counter) % len(nodes)]


@dataclass
class LeastLoaded:
    """Fewest in-flight tokens, with the node's KV usage weighed in (as vllm-ascend's proxy does)."""

    kv_weight_tokens: int = 4096  # a full KV pool counts as this many in-flight tokens

    def choose(self, nodes: list[Node], tokens: int) -> Node:
        return min(nodes, key=lambda n: (n.active_tokens + n.reserved_tokens + self.kv_weight_tokens * n.kv_usage,
                                          n.coming_requests))


# --policy: a new policy is a class with `choose(nodes, tokens)` plus one entry (or POLICIES.register).
POLICIES: Registry[Policy] = Registry("policy", {"round_robin": RoundRobin, "least_loaded": LeastLoaded})


class NoHealthyNode(RuntimeError):
    pass


def _select(nodes: list[Node], policy: Policy, tokens: int, role: str) -> Node:
    candidates = [n for n in nodes if n.healthy]
    if not candidates:
        raise NoHealthyNode(f"no healthy {role} node")
    return policy.choose(candidates, tokens)


def select_prefiller(prefillers: list[Node], policy: Policy, tokens: int) -> Node:
    return _select(prefillers, policy, tokens, "prefill")


def select_decoder(decoders: list[Node], policy: Policy, tokens: int) -> Node:
    """The node that serves the answer: a decode node, or a colocated node in colocated mode."""
    role = "colocated" if decoders and decoders[0].role == "both" else "decode"
    return _select(decoders, policy, tokens, role)
