"""The transport interface: how KV block bytes move between this node's pool and a peer's.

Every transfer has an active side, which knows both block lists and drives it (D when it pulls,
P when it pushes), and a passive side, which serves it on its end of the side-channel
connection. Pull and push (kv/pull.py, kv/push.py) are written once against the four verbs
below; a transport only moves bytes. Each verb returns the bytes it moved, also where the peer
did the copy, so that both ends count every transfer once, whatever the transport.

A node's pools are one per TP rank (all in this host's memory). Each verb moves one `Piece` of the
read plan (kv/tp_plan.py): a run of KV heads between this node's rank `piece.rank` and the peer's
`piece.peer_rank`; without TP, the one piece is all heads, rank 0 to rank 0.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pdserve.kv.pool import KVPool
    from pdserve.kv.tp_plan import Piece


TCP_ONLY = ("tcp",)  # what a peer that advertises none serves: every node serves tcp


@dataclass(frozen=True)
class PeerAddress:
    """A peer as its kv_transfer_params advertise it, before any connection: its side channel's
    host and the transports it serves (`auto` takes the first of ours that reaches it)."""

    host: str
    advertised: tuple[str, ...] = ()

    @property
    def transports(self) -> tuple[str, ...]:
        return self.advertised or TCP_ONLY


@dataclass(frozen=True)
class PeerPool:
    """What the active side knows of the peer's pools once the peer has accepted the transfer."""

    host: str
    num_blocks: int  # of each rank's pool
    tp_size: int = 1
    handshake: bytes = b""  # the peer's transport describing its side (Transport.handshake): opaque here


class Transport(ABC):
    name: ClassVar[str]
    # The active side's writes are a memcpy, cheaper on the engine thread than handed to a
    # sender thread (which pays off for socket writes that overlap the next layers' compute).
    copies_inline: ClassVar[bool] = False
    # Pools must be created in shared memory for a peer to use this transport.
    needs_shared_pool: ClassVar[bool] = False

    def __init__(self, pools: list[KVPool], host: str = "127.0.0.1") -> None:
        self.pools = pools  # by TP rank
        self.pool = pools[0]
        self.host = host  # the node's KV host: where a transfer engine of its own listens

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this transport cannot run in this process (a library missing), or None."""
        return None

    @classmethod
    def reaches(cls, peer: PeerAddress, here: str | None = None) -> bool:
        """Whether this transport can reach that peer from this process, or (`here`) from a node
        whose KV host is `here` (the proxy pricing a pair). `auto` takes the first registered that can."""
        return cls.name in peer.transports

    @classmethod
    def serve_error(cls, pools: list[KVPool]) -> str | None:
        """Why a node of these pools cannot be the passive side of this transport, or None."""
        return None

    def handshake(self) -> bytes:
        """What an active peer needs to know of this side to move the bytes (shm: the pools'
        segment names; a transfer engine: its session and registered addresses). The passive side
        sends it on the side channel when it accepts a transfer (PullReply, the push's Ack) and
        the active side's transport reads it back from PeerPool.handshake."""
        return b""

    # -- active side ----------------------------------------------------------------------------

    @abstractmethod
    def read(self, conn: socket.socket, peer: PeerPool, piece: Piece, remote_ids: list[int], local_ids: list[int],
             layers: range) -> int:
        """Copy the peer's blocks `remote_ids` into ours `local_ids` (pull)."""

    @abstractmethod
    def write(self, conn: socket.socket, peer: PeerPool, piece: Piece, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        """Copy our blocks `local_ids` into the peer's `remote_ids` (push)."""

    # -- passive side ---------------------------------------------------------------------------
    # By default the peer moves the bytes itself (shm, the one-sided transfer engines): this side
    # only counts them. A two-sided transport (tcp) sends or receives them here.

    def serve_read(self, conn: socket.socket, piece: Piece, local_ids: list[int], layers: range) -> int:
        """The peer is reading our blocks `local_ids` in this order."""
        return self.pools[piece.rank].nbytes(local_ids, layers, piece.heads)

    def serve_write(self, conn: socket.socket, piece: Piece, local_ids: list[int], layers: range) -> int:
        """The peer is writing into our blocks `local_ids`."""
        return self.pools[piece.rank].nbytes(local_ids, layers, piece.heads)

    def close(self) -> None:
        """Drop what the transport mapped or opened."""
