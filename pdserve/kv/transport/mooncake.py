"""mooncake: the Mooncake Transfer Engine (vllm-ascend's MooncakeConnector, SGLang's default) moves
the bytes, one-sided: the active side reads the peer's registered pool memory (pull) or writes into
it (push); the passive side moves nothing and only counts the bytes, as with shm.

Each node runs one engine per transport object, started on its KV host with Mooncake's own P2P
handshake (no metadata server) and the protocol of `PDSERVE_MOONCAKE_PROTOCOL` (tcp by default;
rdma where the hosts have it). Every TP rank's pool is registered once, when the transport is
made. The handshake names the engine's session (host:rpc port) and each rank's pool base address;
a request's blocks move as one batched transfer of runs of blocks consecutive at both ends, per
layer and plane (a piece of a rank's heads: one entry per token slot).

Needs `pip install 'pdserve[mooncake]'` and, on Debian, libibverbs1, librdmacm1 and libnuma1.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading

import msgspec

from pdserve.kv.pool import KVPool, common_runs
from pdserve.kv.protocol import ProtocolError
from pdserve.kv.tp_plan import Piece
from pdserve.kv.transport.base import PeerPool, Transport
from pdserve.models.parallel import kv_heads

PROTOCOL_ENV = "PDSERVE_MOONCAKE_PROTOCOL"
BATCH = 256  # entries per batched call (a tcp lane's queue holds a bounded number)


class MooncakeHandshake(msgspec.Struct, frozen=True):
    """The passive side's engine session and its pools' registered base addresses, by TP rank."""

    session: str
    bases: tuple[int, ...]


def load_engine_class():
    """Mooncake's TransferEngine class, or ImportError naming what is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(f"the mooncake transport needs the Mooncake Transfer Engine "
                          f"(pip install 'pdserve[mooncake]'; Debian: libibverbs1 librdmacm1 libnuma1): {exc}") from exc
    return TransferEngine


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, pools: list[KVPool], host: str = "127.0.0.1") -> None:
        super().__init__(pools, host)
        self.engine = load_engine_class()()
        protocol = os.environ.get(PROTOCOL_ENV, "tcp")
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(f"Mooncake Transfer Engine did not start on {host} over {protocol}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        # One batch in flight per engine: its tcp lanes refuse entries past their queue (four loads
        # of 1024 entries at once failed), and the engine spreads one batch over its lanes itself.
        self._lock = threading.Lock()
        self.bases = [pool.tensor.data_ptr() for pool in pools]
        for pool, base in zip(pools, self.bases):
            if self.engine.register_memory(base, pool.tensor.numel() * pool.tensor.element_size()) != 0:
                raise RuntimeError("Mooncake Transfer Engine could not register the KV pool")

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            load_engine_class()
        except ImportError as exc:
            return str(exc)
        return None

    @classmethod
    def serve_error(cls, pools: list[KVPool]) -> str | None:
        """Checked for every node's advertisement: whether the package is there, not imported (a
        node loads the engine only once a transfer names it; a failing load refuses that one)."""
        if any(pool.tensor.device.type != "cpu" for pool in pools):
            return "the mooncake transport moves CPU KV pools only here"
        if importlib.util.find_spec("mooncake") is None:
            return "the Mooncake Transfer Engine is not installed (pip install 'pdserve[mooncake]')"
        return None

    def handshake(self) -> bytes:
        return msgspec.msgpack.encode(MooncakeHandshake(self.session, tuple(self.bases)))

    # -- active side ----------------------------------------------------------------------------

    def read(self, conn: socket.socket, peer: PeerPool, piece: Piece, remote_ids: list[int], local_ids: list[int],
             layers: range) -> int:
        return self._move(self.engine.batch_transfer_sync_read, peer, piece, local_ids, remote_ids, layers)

    def write(self, conn: socket.socket, peer: PeerPool, piece: Piece, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        return self._move(self.engine.batch_transfer_sync_write, peer, piece, local_ids, remote_ids, layers)

    def _move(self, batch_call, peer: PeerPool, piece: Piece, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        try:
            shake = msgspec.msgpack.decode(peer.handshake, type=MooncakeHandshake)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"the peer sent no mooncake handshake: {exc}") from exc
        if piece.peer_rank >= len(shake.bases):
            raise ProtocolError(f"the peer's mooncake handshake names {len(shake.bases)} pools, not rank "
                                f"{piece.peer_rank}'s")
        pool = self.pools[piece.rank]
        ours = Geometry.of(pool, self.bases[piece.rank])
        theirs = Geometry(shake.bases[piece.peer_rank], pool.num_planes, peer.num_blocks, pool.block_size,
                          len(kv_heads(piece.peer_rank, peer.tp_size, pool.model_kv_heads)), pool.head_bytes)
        local, remote, lengths = entries(ours, theirs, piece, local_ids, remote_ids, layers)
        for i in range(0, len(lengths), BATCH):
            with self._lock:
                failed = batch_call(shake.session, local[i : i + BATCH], remote[i : i + BATCH], lengths[i : i + BATCH])
            if failed:
                raise ProtocolError(f"Mooncake transfer with {shake.session} failed")
        return sum(lengths)

    # -- passive side: the peer's engine moves the bytes -----------------------------------------

    def serve_read(self, conn: socket.socket, piece: Piece, local_ids: list[int], layers: range) -> int:
        return self.pools[piece.rank].nbytes(local_ids, layers, piece.heads)

    def serve_write(self, conn: socket.socket, piece: Piece, local_ids: list[int], layers: range) -> int:
        return self.pools[piece.rank].nbytes(local_ids, layers, piece.heads)

    def close(self) -> None:
        for base in self.bases:
            self.engine.unregister_memory(base)
        self.bases = []


class Geometry(msgspec.Struct, frozen=True):
    """Where a rank's pool keeps each (layer slot, plane, block, token slot, head): [slot, plane,
    block, token, head, head_dim] in row-major order from `base`."""

    base: int
    planes: int
    blocks: int
    block_size: int
    heads: int
    head_bytes: int

    @classmethod
    def of(cls, pool: KVPool, base: int) -> Geometry:
        return cls(base, pool.num_planes, pool.num_blocks, pool.block_size, pool.num_kv_heads, pool.head_bytes)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.heads * self.head_bytes

    def block(self, layer: int, plane: int, block: int) -> int:
        return self.base + ((layer * self.planes + plane) * self.blocks + block) * self.block_bytes


def entries(ours: Geometry, theirs: Geometry, piece: Piece, local_ids: list[int], remote_ids: list[int],
            layers: range) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) moving `piece`'s heads of the blocks: runs of
    blocks consecutive at both ends as one entry per layer and plane where the piece is both ranks'
    every head, else one entry per block and token slot (the piece's heads are a run there)."""
    local, remote, lengths = [], [], []
    whole = piece.heads == range(ours.heads) and piece.peer_heads == range(theirs.heads)
    runs = common_runs(local_ids, remote_ids)
    for layer in layers:
        for plane in range(ours.planes):
            for ours_first, theirs_first, count in runs:
                if whole:
                    local.append(ours.block(layer, plane, ours_first))
                    remote.append(theirs.block(layer, plane, theirs_first))
                    lengths.append(count * ours.block_bytes)
                    continue
                span = len(piece.heads) * ours.head_bytes
                for k in range(count):
                    a = ours.block(layer, plane, ours_first + k) + piece.heads.start * ours.head_bytes
                    b = theirs.block(layer, plane, theirs_first + k) + piece.peer_heads.start * theirs.head_bytes
                    for slot in range(ours.block_size):
                        local.append(a + slot * ours.heads * ours.head_bytes)
                        remote.append(b + slot * theirs.heads * theirs.head_bytes)
                        lengths.append(span)
    return local, remote, lengths

