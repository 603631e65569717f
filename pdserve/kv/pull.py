"""Pull mode, worker side: P serves held blocks to D over the side channel; D loads them.

P (`KVSender`): a TCP server on `--kv-host`/`--kv-port`. For each `PullRequest` it pins the held
request (so expiry cannot free blocks mid-copy), streams the block bytes (tcp) or names its shared
pool (shm), waits for `PullDone` and releases the hold.

D (`KVReceiver`): loads run on a small thread pool, never on the engine thread; each lands bytes
straight into the request's pre-allocated blocks and reports (request id, error) back.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdserve.kv.channel import SideChannelServer, connect
from pdserve.kv.pool import KVPool, RemotePool
from pdserve.kv.protocol import Ack, ProtocolError, PullDone, PullReply, PullRequest, recv_msg, send_msg
from pdserve.kv.stats import KVStats

logger = logging.getLogger(__name__)


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    pinned: int = 0
    done: bool = False


class HeldBlocks:
    """P's registry of finished requests whose blocks wait for a D (shared by engine and server)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._holds[request_id] = _Hold(list(block_ids), time.monotonic() + self.timeout_s)

    def pin(self, request_id: str, block_ids: list[int]) -> str | None:
        """Reserve the hold for one transfer; an error message if the request may not be read."""
        with self._lock:
            h = self._holds.get(request_id)
            if h is None or h.done:
                return f"no KV held for request {request_id!r} (expired, already pulled, or unknown)"
            if time.monotonic() > h.deadline and not h.pinned:
                return f"KV hold of request {request_id!r} expired"
            if not set(block_ids) <= set(h.block_ids):
                return f"blocks requested are not held for request {request_id!r}"
            h.pinned += 1
            return None

    def unpin(self, request_id: str, done: bool) -> None:
        with self._lock:
            h = self._holds.get(request_id)
            if h is not None:
                h.pinned -= 1
                h.done = h.done or done

    def release(self, request_id: str) -> bool:
        """D will never pull this request: its blocks are freed (once no pull is in progress)."""
        with self._lock:
            h = self._holds.get(request_id)
            if h is not None:
                h.done = True
            return h is not None

    def pop_releasable(self) -> list[tuple[str, bool]]:
        """(request id, expired) of holds whose blocks can be freed now: pulled, or expired and idle."""
        now, out = time.monotonic(), []
        with self._lock:
            for rid, h in list(self._holds.items()):
                if h.pinned:
                    continue
                if h.done or now > h.deadline:
                    out.append((rid, not h.done))
                    del self._holds[rid]
        return out

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())


MAX_IOV = 512  # buffers per sendmsg / recvmsg_into call (IOV_MAX is 1024 on Linux)
LARGE_SEGMENT = 64 << 10


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
    return sum(length for _, length in segments)


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


class KVSender:
    """P's side channel server."""

    def __init__(self, pool: KVPool, held: HeldBlocks, stats: KVStats, host: str, port: int, secret: bytes = b"") -> None:
        self.pool, self.held, self.stats = pool, held, stats
        self.data = pool.byte_view()
        self.channel = SideChannelServer(host, port, "kv-sender", (PullRequest, PullDone), self._serve, secret)
        self.host, self.port = host, self.channel.port

    def _serve(self, conn: socket.socket, req: PullRequest | PullDone) -> None:
        if isinstance(req, PullDone):  # opening with PullDone: D drops the request without pulling
            send_msg(conn, Ack(ok=self.held.release(req.request_id)))
            return
        if req.layout != self.pool.layout:
            send_msg(conn, PullReply(ok=False, error=f"KV layout mismatch: P {self.pool.layout}, D {req.layout}"))
            return
        if req.transport == "shm" and self.pool.shm_name is None:
            send_msg(conn, PullReply(ok=False, error="this node has no shared-memory KV pool"))
            return
        error = self.held.pin(req.request_id, req.block_ids)
        if error:
            send_msg(conn, PullReply(ok=False, error=error))
            return
        done = False
        try:
            start = time.perf_counter()
            send_msg(conn, PullReply(ok=True, shm_name=self.pool.shm_name, pool_num_blocks=self.pool.num_blocks))
            if req.transport == "tcp":
                sent = send_segments(conn, self.data, self.pool.segments(req.block_ids))
                self.stats.add_sent(sent, time.perf_counter() - start)
            reply = recv_msg(conn)
            done = isinstance(reply, PullDone) and reply.ok
        finally:
            self.held.unpin(req.request_id, done)
        if done:
            send_msg(conn, Ack())

    def close(self) -> None:
        self.channel.close()


@dataclass
class LoadSpec:
    """One request's blocks to fetch from a P."""

    request_id: str  # D's request id
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_shm_name: str | None = None


@dataclass
class LoadResult:
    request_id: str
    error: str | None
    seconds: float = 0.0
    nbytes: int = 0
    transport: str = field(default="tcp")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KVReceiver:
    """D's loader."""

    def __init__(self, pool: KVPool, stats: KVStats, transport: str, timeout_s: float, secret: bytes = b"",
                 max_workers: int = 4) -> None:
        self.pool, self.stats = pool, stats
        self.secret = secret
        self.transport = transport
        self.timeout_s = timeout_s
        self.data = pool.byte_view()
        self.results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-load")
        self._remote_pools: dict[str, RemotePool] = {}
        self._lock = threading.Lock()

    def choose_transport(self, spec: LoadSpec) -> str:
        if self.transport == "auto":
            return "shm" if spec.remote_shm_name and is_loopback(spec.remote_host) else "tcp"
        return self.transport

    def start(self, spec: LoadSpec) -> None:
        self._executor.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        transport = self.choose_transport(spec)
        start = time.perf_counter()
        try:
            nbytes = self._pull(spec, transport)
        except Exception as exc:  # noqa: BLE001 - any failure is reported, never raised on a pool thread
            logger.warning("KV load of %s from %s:%s failed: %s", spec.request_id, spec.remote_host, spec.remote_port, exc)
            self.stats.add_failed()
            self.results.put(LoadResult(spec.request_id, f"{type(exc).__name__}: {exc}", transport=transport))
            return
        seconds = time.perf_counter() - start
        self.stats.add_received(nbytes, seconds)
        self.results.put(LoadResult(spec.request_id, None, seconds, nbytes, transport))

    def _pull(self, spec: LoadSpec, transport: str) -> int:
        with connect(spec.remote_host, spec.remote_port, self.timeout_s, self.secret) as sock:
            send_msg(sock, PullRequest(spec.remote_request_id, spec.remote_block_ids, transport, self.pool.layout))
            reply = recv_msg(sock)
            if not isinstance(reply, PullReply) or not reply.ok:
                raise ProtocolError(getattr(reply, "error", None) or "unexpected reply")
            if transport == "tcp":
                nbytes = recv_segments(sock, self.data, self.pool.segments(spec.local_block_ids))
            else:
                remote = self._remote_pool(reply.shm_name, reply.pool_num_blocks)
                nbytes = remote.copy_blocks(spec.remote_block_ids, self.pool, spec.local_block_ids)
            send_msg(sock, PullDone(spec.remote_request_id))
            if not isinstance(recv_msg(sock), Ack):
                raise ProtocolError("P did not acknowledge the pull")
            return nbytes

    def release(self, spec: LoadSpec) -> None:
        """Tell P (in the background) that this request will never pull, so it frees its hold."""
        self._executor.submit(self._release, spec)

    def _release(self, spec: LoadSpec) -> None:
        try:
            with connect(spec.remote_host, spec.remote_port, self.timeout_s, self.secret) as sock:
                send_msg(sock, PullDone(spec.remote_request_id))
                recv_msg(sock)
        except (OSError, ProtocolError) as exc:  # P gone: its hold times out on its own
            logger.info("releasing %s on %s:%s failed: %s", spec.remote_request_id, spec.remote_host,
                        spec.remote_port, exc)

    def _remote_pool(self, name: str, num_blocks: int) -> RemotePool:
        with self._lock:
            pool = self._remote_pools.get(name)
            if pool is None:
                shape = (self.pool.num_layers, 2, num_blocks, *self.pool.shape[3:])
                pool = self._remote_pools[name] = RemotePool(name, shape, self.pool.dtype)
            return pool

    def poll(self, timeout: float = 0.0) -> list[LoadResult]:
        """Finished loads; waits up to `timeout` seconds for the first one."""
        out = []
        while True:
            try:
                out.append(self.results.get(timeout=timeout) if timeout and not out else self.results.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for pool in self._remote_pools.values():
            pool.close()
