"""tcp: the block bytes stream over the side-channel socket, straight from and into the pools
(scatter/gather calls over the blocks' segments, no staging buffer). Works between any hosts.
A piece of some of a rank's heads (P and D with different TP) is gathered into, or scattered from,
one contiguous buffer in the same canonical order."""

from __future__ import annotations

import socket

import torch

from pdserve.kv.pool import KVPool, tensor_bytes
from pdserve.kv.protocol import ProtocolError
from pdserve.kv.tp_plan import Piece
from pdserve.kv.transport.base import PeerPool, Transport

MAX_IOV = 512  # buffers per sendmsg / recvmsg_into call (IOV_MAX is 1024 on Linux)
LARGE_SEGMENT = 64 << 10


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, pools: list[KVPool], host: str = "127.0.0.1") -> None:
        super().__init__(pools, host)
        self.data = [pool.byte_view() for pool in pools]

    def read(self, conn: socket.socket, peer: PeerPool, piece: Piece, remote_ids: list[int], local_ids: list[int],
             layers: range) -> int:
        return self._recv(conn, piece, local_ids, layers)

    def write(self, conn: socket.socket, peer: PeerPool, piece: Piece, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        return self._send(conn, piece, local_ids, layers)

    def serve_read(self, conn: socket.socket, piece: Piece, local_ids: list[int], layers: range) -> int:
        return self._send(conn, piece, local_ids, layers)

    def serve_write(self, conn: socket.socket, piece: Piece, local_ids: list[int], layers: range) -> int:
        return self._recv(conn, piece, local_ids, layers)

    def _send(self, conn: socket.socket, piece: Piece, block_ids: list[int], layers: range) -> int:
        pool = self.pools[piece.rank]
        if pool.holds_all(piece.heads):
            return send_segments(conn, self.data[piece.rank], pool.segments(block_ids, layers))
        staged = pool.gather(block_ids, layers, piece.heads)
        conn.sendall(tensor_bytes(staged))
        return staged.numel() * staged.element_size()

    def _recv(self, conn: socket.socket, piece: Piece, block_ids: list[int], layers: range) -> int:
        pool = self.pools[piece.rank]
        if pool.holds_all(piece.heads):
            return recv_segments(conn, self.data[piece.rank], pool.segments(block_ids, layers))
        shape = pool.heads_view(layers, piece.heads)[:, :, : len(block_ids)].shape
        staged = torch.empty(shape, dtype=pool.dtype)
        nbytes = recv_segments(conn, tensor_bytes(staged), [(0, staged.numel() * staged.element_size())])
        pool.scatter(block_ids, layers, piece.heads, staged)
        return nbytes


def _views(data: memoryview, segments: list[tuple[int, int]]) -> list[memoryview]:
    return [data[offset : offset + length] for offset, length in segments]


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes from a list of buffers (after a partial scatter/gather call)."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def send_segments(sock: socket.socket, data: memoryview, segments: list[tuple[int, int]]) -> int:
    """Send the segments as one byte stream. Large segments go one sendall each (fastest on
    loopback); many small ones (scattered blocks) go many buffers per sendmsg call."""
    views = _views(data, segments)
    total = sum(length for _, length in segments)
    if views and total // len(views) >= LARGE_SEGMENT:
        for view in views:
            sock.sendall(view)
        return total
    while views:
        batch = views[:MAX_IOV]
        sent = sock.sendmsg(batch)
        views = _advance(batch, sent) + views[MAX_IOV:]
    return total


def recv_segments(sock: socket.socket, data: memoryview, segments: list[tuple[int, int]]) -> int:
    """Receive the byte stream straight into the pool's segments, in order (no staging buffer)."""
    views = _views(data, segments)
    while views:
        batch = views[:MAX_IOV]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ProtocolError("KV stream cut before all blocks arrived")
        views = _advance(batch, got) + views[MAX_IOV:]
    return sum(length for _, length in segments)
