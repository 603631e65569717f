"""NodeTransports by name. A new transport is one module with a `Transport` subclass plus one line
here; `tests/test_transports.py` runs the conformance suite against every entry. Whatever a
transport needs of its peer (shm's segment names, a transfer engine's session and addresses) it
puts in its own handshake (Transport.handshake), which the side channel carries as opaque bytes:
no other module knows a transport's fields.

A node makes a transport the first time it uses it (a node never imports an engine it does not
use), and advertises in its kv_transfer_params the ones it can serve (`remote_transports`).

Order matters: `auto` takes the first transport that reaches the peer (shm on the same host,
else tcp, which reaches everywhere). The order is measured (docs/benchmarks.md, transfer): shm is
the fastest path on one host and tcp reached 98 % of the link between hosts, ahead of Mooncake and
NIXL over tcp; the transfer engines run when named (RDMA hosts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kv.transport.base import TCP_ONLY, PeerAddress, PeerPool, Transport
from pdserve.registry import Registry

if TYPE_CHECKING:  # the registry imports nothing heavy: the CLI reads it for its choices
    from pdserve.kv.pool import KVPool
    from pdserve.kv.protocol import KVLayout
    from pdserve.kv.tp_plan import Piece

TRANSPORTS: Registry[Transport] = Registry("KV transport", {
    "shm": "pdserve.kv.transport.shm:ShmTransport",
    "tcp": "pdserve.kv.transport.tcp:TcpTransport",
    "mooncake": "pdserve.kv.transport.mooncake:MooncakeTransport",
    "nixl": "pdserve.kv.transport.nixl:NixlTransport",
})
AUTO = "auto"

__all__ = ["AUTO", "TCP_ONLY", "TRANSPORTS", "NodeTransports", "PeerAddress", "PeerPool", "Transport",
           "available", "check_available", "choose_transport", "transport_class",
           "uses_shared_pool"]


class NodeTransports(dict[str, Transport]):
    """A node's transports by name, over its pools, one per TP rank, each made when first asked
    for (a passive side serves whichever a peer names)."""

    def __init__(self, pools: list[KVPool], host: str = "127.0.0.1") -> None:
        super().__init__()
        self.pools = pools
        self.pool = pools[0]
        self.host = host  # the node's KV host (a transfer engine listens there)

    def __missing__(self, name: str) -> Transport:
        transport = self[name] = transport_class(name)(self.pools, self.host)
        return transport

    @property
    def tp_size(self) -> int:
        return len(self.pools)

    def served(self) -> tuple[str, ...]:
        """The transports a peer may name to this node (what its kv_transfer_params advertise)."""
        return tuple(name for name in TRANSPORTS if transport_class(name).serve_error(self.pools) is None)

    def pieces(self, peer_tp: int, producer: bool) -> list[Piece]:
        """This node's side of the read plan with a peer of TP `peer_tp` (ValueError if it cannot split the heads)."""
        from pdserve.kv.tp_plan import pieces

        tp_p, tp_d = (self.tp_size, peer_tp) if producer else (peer_tp, self.tp_size)
        return pieces(self.pool.model_kv_heads, tp_p, tp_d, producer)

    def to_serve(self, name: str, layout: KVLayout, peer_tp: int, producer: bool) -> tuple[Transport, list[Piece]] | str:
        """The transport a peer named for a transfer it drives and this node's side of the read plan,
        or why this node cannot serve it."""
        if layout != self.pool.layout:
            ours = self.pool.layout
            differ = [f"{field} {getattr(ours, field)} here, {getattr(layout, field)} on the peer"
                      for field in ours.__struct_fields__ if getattr(ours, field) != getattr(layout, field)]
            return "KV layout mismatch: " + "; ".join(differ)
        if name not in TRANSPORTS:
            return f"unknown KV transport {name!r}"
        error = transport_class(name).serve_error(self.pools)
        if error:
            return error
        try:
            plan = self.pieces(peer_tp, producer)
        except ValueError as exc:
            return str(exc)
        try:
            return self[name], plan
        except (ImportError, RuntimeError) as exc:  # a transfer engine that would not start here
            return f"KV transport {name!r} cannot start on this node: {exc}"

    def digests(self, plan: list[Piece], runs: list[tuple[int, range, int]], tables: list[list[int]]) -> list[int]:
        """A transfer's digests on this end: one per piece of the read plan and KV group run
        (KVPool.group_runs), over this end's `tables` (one per group) in the order the bytes move."""
        return [self.pools[piece.rank].digest(tables[group][skip:], slots, piece.heads)
                for piece in plan for group, slots, skip in runs]

    def close(self) -> None:
        for transport in self.values():
            transport.close()
        self.clear()  # a transfer engine's threads stop with its last reference


def transport_class(name: str) -> type[Transport]:
    return TRANSPORTS.get(name)


def available() -> tuple[str, ...]:
    """The registered transports that can run in this process (a transfer engine's library loads)."""
    return tuple(name for name in TRANSPORTS if not transport_class(name).unavailable())


def check_available(configured: str) -> None:
    """ValueError naming `--kv-transport` and what is missing, where the configured transport
    cannot run in this process (its library absent); auto needs none beyond tcp."""
    if configured != AUTO:
        reason = transport_class(configured).unavailable()
        if reason:
            raise ValueError(f"--kv-transport {configured}: {reason}")


def choose_transport(configured: str, peer: PeerAddress, here: str | None = None) -> str:
    """The transport to use with a peer: the configured one, or for auto the first that reaches it
    (tcp, whatever the peer advertises: every node serves it). `here`: as a node whose KV host it
    is would choose (the proxy pricing a pair; None: this process)."""
    if configured != AUTO:
        return configured
    return next((name for name in TRANSPORTS if transport_class(name).reaches(peer, here)), TCP_ONLY[0])


def uses_shared_pool(configured: str) -> bool:
    """Whether a node configured with this transport keeps its pool in shared memory."""
    names = TRANSPORTS if configured == AUTO else [configured]
    return any(transport_class(name).needs_shared_pool for name in names)
