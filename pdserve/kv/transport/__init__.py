"""NodeTransports by name. A new transport is one module with a `Transport` subclass plus one line
here; `tests/test_transports.py` runs the conformance suite against every entry.

Order matters: `auto` takes the first transport that reaches the peer (shm on the same host,
else tcp, which reaches everywhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kv.transport.base import PeerPool, Transport
from pdserve.registry import Registry

if TYPE_CHECKING:  # the registry imports nothing heavy: the CLI reads it for its choices
    from pdserve.kv.pool import KVPool
    from pdserve.kv.protocol import KVLayout
    from pdserve.kv.tp_plan import Piece

TRANSPORTS: Registry[Transport] = Registry("KV transport", {
    "shm": "pdserve.kv.transport.shm:ShmTransport",
    "tcp": "pdserve.kv.transport.tcp:TcpTransport",
})
AUTO = "auto"

__all__ = ["AUTO", "TRANSPORTS", "NodeTransports", "PeerPool", "Transport", "choose_transport",
           "transport_class", "uses_shared_pool"]


class NodeTransports(dict[str, Transport]):
    """A node's transports by name, over its pools, one per TP rank (a passive side serves whichever
    a peer names)."""

    def __init__(self, pools: list[KVPool]) -> None:
        super().__init__({name: transport_class(name)(pools) for name in TRANSPORTS})
        self.pools = pools
        self.pool = pools[0]

    @property
    def tp_size(self) -> int:
        return len(self.pools)

    @property
    def shm_names(self) -> list[str]:
        """The pools in shared memory, by rank (none unless every rank's is)."""
        names = [pool.shm_name for pool in self.pools]
        return names if all(names) else []

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
        transport = self.get(name)
        if transport is None:
            return f"unknown KV transport {name!r}"
        try:
            plan = self.pieces(peer_tp, producer)
        except ValueError as exc:
            return str(exc)
        return transport.serve_error() or (transport, plan)

    def close(self) -> None:
        for transport in self.values():
            transport.close()


def transport_class(name: str) -> type[Transport]:
    return TRANSPORTS.get(name)


def choose_transport(configured: str, peer_host: str, peer_shm_name: str | None) -> str:
    """The transport to use with a peer: the configured one, or for auto the first that reaches it."""
    if configured != AUTO:
        return configured
    return next(name for name in TRANSPORTS if transport_class(name).reaches(peer_host, peer_shm_name))


def uses_shared_pool(configured: str) -> bool:
    """Whether a node configured with this transport keeps its pool in shared memory."""
    names = TRANSPORTS if configured == AUTO else [configured]
    return any(transport_class(name).needs_shared_pool for name in names)
