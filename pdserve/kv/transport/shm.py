"""shm: the active side maps the peer's shared-memory pool and copies the blocks with memcpy
(D out of P's pool when pulling, P into D's pool when pushing). Same host only; the passive side
moves nothing and only counts the bytes."""

from __future__ import annotations

import ipaddress
import socket
import threading

from pdserve.kv.pool import KVPool, RemotePool, copy_block_runs
from pdserve.kv.protocol import ProtocolError
from pdserve.kv.transport.base import PeerPool, Transport


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


class ShmTransport(Transport):
    name = "shm"
    copies_inline = True
    needs_shared_pool = True

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self._remote_pools: dict[str, RemotePool] = {}
        self._lock = threading.Lock()  # loads run on several threads

    @staticmethod
    def reaches(peer_host: str, peer_shm_name: str | None) -> bool:
        return bool(peer_shm_name) and on_this_host(peer_host)

    def serve_error(self) -> str | None:
        return None if self.pool.shm_name else "this node has no shared-memory KV pool"

    def read(self, conn: socket.socket, peer: PeerPool, remote_ids: list[int], local_ids: list[int],
             layers: range) -> int:
        remote = self._map(peer)
        sl = slice(layers.start, layers.stop)
        return copy_block_runs(remote.tensor[sl], remote_ids, self.pool.tensor[sl], local_ids)

    def write(self, conn: socket.socket, peer: PeerPool, local_ids: list[int], remote_ids: list[int],
              layers: range) -> int:
        remote = self._map(peer)
        sl = slice(layers.start, layers.stop)
        return copy_block_runs(self.pool.tensor[sl], local_ids, remote.tensor[sl], remote_ids)

    def serve_read(self, conn: socket.socket, local_ids: list[int], layers: range) -> int:
        return self.pool.nbytes(local_ids, layers)

    def serve_write(self, conn: socket.socket, local_ids: list[int], layers: range) -> int:
        return self.pool.nbytes(local_ids, layers)

    def _map(self, peer: PeerPool) -> RemotePool:
        if not peer.shm_name:
            raise ProtocolError("the peer has no shared-memory KV pool")
        with self._lock:
            remote = self._remote_pools.get(peer.shm_name)
            if remote is None:
                shape = (*self.pool.shape[:2], peer.num_blocks, *self.pool.shape[3:])
                remote = self._remote_pools[peer.shm_name] = RemotePool(peer.shm_name, shape, self.pool.dtype)
            return remote

    def close(self) -> None:
        with self._lock:
            for remote in self._remote_pools.values():
                remote.close()
            self._remote_pools.clear()
