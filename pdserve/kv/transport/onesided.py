"""One-sided transports: a transfer engine on each node registers every TP rank's pool once, and the
active side reads the peer's registered memory (pull) or writes into it (push) by address; the
passive side moves nothing and only counts the bytes, as with shm. Mooncake and NIXL differ only in
how they start, register, name an endpoint and move a batch (`OneSidedTransport`'s four hooks).

The handshake carries the engine's endpoint (Mooncake: host:rpc port; NIXL: the agent's metadata)
and each rank's pool base address. A request's blocks move as one batch of entries: runs of blocks
consecutive at both ends, one entry per layer and plane; a TP piece of some of a rank's heads, one
entry per block and token slot (the heads are a run there).
"""

from __future__ import annotations

import importlib.util
import socket
from abc import abstractmethod

import msgspec

from pdserve.kv.pool import KVPool, block_offset, common_runs
from pdserve.kv.protocol import ProtocolError
from pdserve.kv.tp_plan import Piece
from pdserve.kv.transport.base import PeerPool, Transport
from pdserve.models.parallel import kv_heads


class OneSidedHandshake(msgspec.Struct, frozen=True):
    """The passive side's engine endpoint and its pools' registered base addresses, by TP rank."""

    endpoint: bytes
    bases: tuple[int, ...]


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
        return self.base + block_offset(layer, plane, block, self.planes, self.blocks, self.block_bytes)


class OneSidedTransport(Transport):
    package: str  # the import name whose presence serve_error checks (not importing it)
    install: str  # how to get it, for the messages

    def __init__(self, pools: list[KVPool], host: str = "127.0.0.1") -> None:
        super().__init__(pools, host)
        self._start()
        self.bases = [pool.tensor.data_ptr() for pool in pools]
        for pool, base in zip(pools, self.bases):
            self._register(base, pool.tensor.numel() * pool.tensor.element_size())

    # -- what each engine does ------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def load(cls):
        """The engine's module or class; ImportError naming what is missing."""

    @abstractmethod
    def _start(self) -> None:
        """Start this node's engine on self.host."""

    @abstractmethod
    def _register(self, base: int, nbytes: int) -> None: ...

    @abstractmethod
    def _unregister(self, base: int) -> None: ...

    @abstractmethod
    def _endpoint(self) -> bytes:
        """What a peer's engine needs to reach this one."""

    @abstractmethod
    def _batch(self, write: bool, endpoint: bytes, local: list[int], remote: list[int], lengths: list[int]) -> None:
        """Move the entries (read the peer's into ours, or write ours into the peer's) and return
        once they are done; ProtocolError if they failed."""

    # -- the Transport --------------------------------------------------------------------------

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            cls.load()
        except ImportError as exc:
            return str(exc)
        return None

    @classmethod
    def serve_error(cls, pools: list[KVPool]) -> str | None:
        """Checked for every node's advertisement: whether the package is there, not imported (a
        node loads the engine only once a transfer names it; a failing load refuses that one)."""
        if any(pool.tensor.device.type != "cpu" for pool in pools):
            return f"the {cls.name} transport moves CPU KV pools only here"
        if importlib.util.find_spec(cls.package) is None:
            return f"the {cls.name} transport is not installed ({cls.install})"
        return None

    def handshake(self) -> bytes:
        return msgspec.msgpack.encode(OneSidedHandshake(self._endpoint(), tuple(self.bases)))

    def read(self, conn: socket.socket, peer: PeerPool, piece: Piece, remote_ids: list[int], local_ids: list[int],
             layers: range) -> int:
        return self._move(False, peer, piece, local_ids, remote_ids, layers)

    def write(self, conn: socket.socket, peer: PeerPool, piece: Piece, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        return self._move(True, peer, piece, local_ids, remote_ids, layers)

    def _move(self, write: bool, peer: PeerPool, piece: Piece, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        try:
            shake = msgspec.msgpack.decode(peer.handshake, type=OneSidedHandshake)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"the peer sent no {self.name} handshake: {exc}") from exc
        if piece.peer_rank >= len(shake.bases):
            raise ProtocolError(f"the peer's {self.name} handshake names {len(shake.bases)} pools, not rank "
                                f"{piece.peer_rank}'s")
        pool = self.pools[piece.rank]
        ours = Geometry.of(pool, self.bases[piece.rank])
        theirs = Geometry(shake.bases[piece.peer_rank], pool.num_planes, peer.num_blocks, pool.block_size,
                          len(kv_heads(piece.peer_rank, peer.tp_size, pool.model_kv_heads)), pool.head_bytes)
        local, remote, lengths = entries(ours, theirs, piece, local_ids, remote_ids, layers)
        if lengths:
            self._batch(write, shake.endpoint, local, remote, lengths)
        return sum(lengths)

    def close(self) -> None:
        for base in self.bases:
            self._unregister(base)
        self.bases = []


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
