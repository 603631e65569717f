"""shm: the active side maps the peer's shared-memory pool and copies the blocks with memcpy
(D out of P's pool when pulling, P into D's pool when pushing). Same host only; the passive side
moves nothing and only counts the bytes."""

from __future__ import annotations

import socket
import threading

import msgspec

from pdserve.kv.hosts import is_loopback, same_host
from pdserve.kv.pool import KVPool, copy_block_runs
from pdserve.kv.protocol import ProtocolError
from pdserve.kv.tp_plan import Piece
from pdserve.kv.transport.base import PeerAddress, PeerPool, Transport
from pdserve.models.parallel import kv_heads


def on_this_host(host: str) -> bool:
    """Whether `host` is an address of this machine (of this network namespace): loopback, or one
    a socket here can bind. A peer advertising it shares this machine's memory."""
    if is_loopback(host):
        return True
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


class ShmHandshake(msgspec.Struct, frozen=True):
    """shm's side of the handshake: the passive node's pools in shared memory, by TP rank."""

    segments: tuple[str, ...]


class ShmTransport(Transport):
    name = "shm"
    copies_inline = True
    needs_shared_pool = True

    def __init__(self, pools: list[KVPool], host: str = "127.0.0.1") -> None:
        super().__init__(pools, host)
        self._remote_pools: dict[str, KVPool] = {}
        self._lock = threading.Lock()  # loads run on several threads

    @classmethod
    def reaches(cls, peer: PeerAddress, here: str | None = None) -> bool:
        if cls.name not in peer.transports:
            return False
        if here is None:
            return on_this_host(peer.host)
        return same_host(peer.host, here)

    @classmethod
    def serve_error(cls, pools: list[KVPool]) -> str | None:
        return None if all(pool.shm_name for pool in pools) else "this node has no shared-memory KV pool"

    def handshake(self) -> bytes:
        return msgspec.msgpack.encode(ShmHandshake(tuple(pool.shm_name for pool in self.pools)))

    def read(self, conn: socket.socket, peer: PeerPool, piece: Piece, remote_ids: list[int], local_ids: list[int],
             layers: range) -> int:
        remote = self._map(peer, piece.peer_rank).heads_view(layers, piece.peer_heads)
        return copy_block_runs(remote, remote_ids, self.pools[piece.rank].heads_view(layers, piece.heads), local_ids)

    def write(self, conn: socket.socket, peer: PeerPool, piece: Piece, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        remote = self._map(peer, piece.peer_rank).heads_view(layers, piece.peer_heads)
        return copy_block_runs(self.pools[piece.rank].heads_view(layers, piece.heads), local_ids, remote, remote_ids)

    def _map(self, peer: PeerPool, rank: int) -> KVPool:
        """The peer's rank `rank` pool, mapped once: its ranks hold other shares of the heads than ours."""
        try:
            segments = msgspec.msgpack.decode(peer.handshake, type=ShmHandshake).segments
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"the peer sent no shm handshake: {exc}") from exc
        if rank >= len(segments):
            raise ProtocolError(f"the peer's shm handshake names {len(segments)} pools, not rank {rank}'s")
        name = segments[rank]
        with self._lock:
            remote = self._remote_pools.get(name)
            if remote is None:
                local = self.pool
                heads = len(kv_heads(0, peer.tp_size, local.model_kv_heads))
                shape = (*local.shape[:2], peer.num_blocks, local.block_size, heads, *local.shape[5:])
                remote = self._remote_pools[name] = KVPool(shape, local.dtype, "cpu", shm_name=name)
            return remote

    def close(self) -> None:
        with self._lock:
            for remote in self._remote_pools.values():
                remote.close()
            self._remote_pools.clear()
