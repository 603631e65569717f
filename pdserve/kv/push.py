"""Layer-wise push, worker side (vllm-ascend's MooncakeLayerwiseConnector, in pdserve's terms).

P (`PushSender`): `save_kv_layer(layer)` is called from the forward pass right after a layer has
written its KV. Over tcp it queues that layer of every pushing request to a sender thread, which
writes it to D's socket straight from the pool while the next layers compute; over shm it copies
the layer into D's shared pool at once (one memcpy, cheaper than a thread hand-off). At the end
of the step `wait_for_save()` waits for the queue; a request's last chunk ends its session with
`PushDone`, and P frees its blocks at once.

D (`PushReceiver`): listens on the side channel, accepts a session only for a request it is
waiting for, lands each layer in that request's reserved blocks, and reports the arrival (or the
failure) like a finished load. A D-side abort cancels the session; blocks are freed only once no
session can write into them any more.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from pdserve.kv.channel import SideChannelServer, connect
from pdserve.kv.pool import KVPool, RemotePool, copy_block_runs
from pdserve.kv.protocol import (
    Ack,
    ProtocolError,
    PushBegin,
    PushDone,
    PushLayer,
    recv_msg,
    send_msg,
)
from pdserve.kv.pull import LoadResult, is_loopback, recv_segments, send_segments
from pdserve.kv.stats import KVStats

logger = logging.getLogger(__name__)


@dataclass
class PushTarget:
    """Where a P request's KV goes: D's request, its blocks and its side channel."""

    request_id: str  # D's
    block_ids: list[int]  # D's blocks for the prompt, block index i <-> P's block i
    first_block: int  # D already holds blocks before this one (its prefix cache)
    host: str
    port: int
    shm_name: str | None = None


@dataclass
class SaveSpec:
    """One step's push work for one request: P's blocks -> D's blocks, and whether it is the last."""

    request_id: str  # P's
    target: PushTarget
    src_block_ids: list[int]
    dst_block_ids: list[int]
    last: bool


@dataclass
class _Session:
    target: PushTarget
    sock: socket.socket | None = None
    remote: RemotePool | None = None
    error: str | None = None
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)


class PushSender:
    """P's pusher. Sessions are opened and ended on the engine thread; shm layers are copied right
    there (a memcpy is cheaper than handing it to a thread on a one-core node); tcp layers go to
    the sender thread, whose socket writes overlap the next layers' compute."""

    def __init__(self, pool: KVPool, stats: KVStats, transport: str, timeout_s: float, secret: bytes = b"") -> None:
        self.pool, self.stats = pool, stats
        self.secret = secret
        self.transport = transport
        self.timeout_s = timeout_s
        self.data = pool.byte_view()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, _Session] = {}
        self._failed: list[tuple[str, str]] = []
        self._failed_lock = threading.Lock()
        self._step: list[tuple[SaveSpec, _Session]] = []
        self._remote_pools: dict[str, RemotePool] = {}
        threading.Thread(target=self._run, name="kv-push", daemon=True).start()

    # -- engine thread --------------------------------------------------------------------------

    def begin_step(self, saves: list[SaveSpec]) -> None:
        """Open (or reuse) each pushing request's session before the forward pass starts."""
        self._step = []
        for spec in saves:
            session = self._sessions.get(spec.request_id)
            if session is None:
                session = self._sessions[spec.request_id] = _Session(spec.target)
                try:
                    self._open(session)
                except (OSError, ProtocolError) as exc:
                    self._fail(spec.request_id, session, f"cannot push to {spec.target.host}:{spec.target.port}: {exc}")
            self._step.append((spec, session))

    def save_kv_layer(self, layer: int) -> None:
        """The forward pass has just written `layer`: push that layer of every pushing request."""
        for spec, session in self._step:
            if session.error or not spec.src_block_ids:
                continue
            if session.remote is None:
                self._tasks.put((self._send_layer, spec, session, layer))
                continue
            try:
                if _peer_cancelled(session.sock):
                    raise ProtocolError("decode node cancelled the push")
                session.nbytes += copy_block_runs(
                    self.pool.tensor[layer : layer + 1], spec.src_block_ids,
                    session.remote.tensor[layer : layer + 1], spec.dst_block_ids,
                )
            except (OSError, ProtocolError) as exc:
                self._fail(spec.request_id, session, str(exc))

    def wait_for_save(self) -> None:
        """Wait until this step's tcp layers are written, then end the sessions of finished prompts."""
        barrier = threading.Event()
        self._tasks.put((lambda *_: barrier.set(), None, None, None))
        barrier.wait()
        for spec, session in self._step:
            if spec.last:
                self._sessions.pop(spec.request_id, None)
                if session.error is None:
                    self._end(session, ok=True)
                    self.stats.add_sent(session.nbytes, time.perf_counter() - session.started)
        self._step = []

    def abort(self, request_id: str) -> None:
        """P's request ended early (aborted): tell D the push is abandoned."""
        session = self._sessions.pop(request_id, None)
        if session is not None:
            self._end(session, ok=False, error="prefill request aborted")

    def failed_requests(self) -> list[tuple[str, str]]:
        """(P request id, why) of pushes D refused or that broke: the engine aborts them."""
        with self._failed_lock:
            out, self._failed = self._failed, []
        return out

    # -- sessions -------------------------------------------------------------------------------

    def _open(self, session: _Session) -> None:
        target = session.target
        transport = self.transport
        if transport == "auto":
            transport = "shm" if target.shm_name and is_loopback(target.host) else "tcp"
        sock = connect(target.host, target.port, self.timeout_s, self.secret)
        session.sock = sock
        send_msg(sock, PushBegin(target.request_id, transport, self.pool.layout))
        reply = recv_msg(sock)
        if not isinstance(reply, Ack) or not reply.ok:
            raise ProtocolError(getattr(reply, "error", None) or "push refused")
        if transport == "shm":
            session.remote = self._remote_pool(target.shm_name, reply.pool_num_blocks)

    def _remote_pool(self, name: str, num_blocks: int) -> RemotePool:
        pool = self._remote_pools.get(name)
        if pool is None:
            shape = (self.pool.num_layers, 2, num_blocks, *self.pool.shape[3:])
            pool = self._remote_pools[name] = RemotePool(name, shape, self.pool.dtype)
        return pool

    def _run(self) -> None:
        """The sender thread: runs queued tcp layer sends (and step barriers) in order."""
        while True:
            fn, spec, session, layer = self._tasks.get()
            fn(spec, session, layer)

    def _send_layer(self, spec: SaveSpec, session: _Session, layer: int) -> None:
        if session.error:
            return
        try:
            if _peer_cancelled(session.sock):
                raise ProtocolError("decode node cancelled the push")
            send_msg(session.sock, PushLayer(layer, spec.dst_block_ids))
            session.nbytes += send_segments(
                session.sock, self.data, self.pool.segments(spec.src_block_ids, range(layer, layer + 1))
            )
        except (OSError, ProtocolError) as exc:
            self._fail(spec.request_id, session, str(exc))

    def _end(self, session: _Session, ok: bool, error: str | None = None) -> None:
        try:
            if session.sock is not None:
                send_msg(session.sock, PushDone(ok, error, session.nbytes))
                if ok:
                    reply = recv_msg(session.sock)
                    if not isinstance(reply, Ack) or not reply.ok:
                        logger.warning("decode node did not accept the push: %s", getattr(reply, "error", reply))
        except (OSError, ProtocolError) as exc:
            logger.warning("ending push session failed: %s", exc)
        finally:
            if session.sock is not None:
                session.sock.close()
                session.sock = None

    def _fail(self, request_id: str, session: _Session, error: str) -> None:
        if session.error is None:
            session.error = error
            logger.warning("push of %s failed: %s", request_id, error)
            self.stats.add_failed()
            with self._failed_lock:
                self._failed.append((request_id, error))
            if session.sock is not None:
                session.sock.close()  # D learns it at once, and knows nothing writes any more
                session.sock = None

    def close(self) -> None:
        for pool in self._remote_pools.values():
            pool.close()


def _peer_cancelled(sock: socket.socket) -> bool:
    """True if D has sent something (a cancel) or closed: P must stop writing into its blocks.
    Never blocks (a recv on a socket with a timeout would wait for data)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


@dataclass
class _Expected:
    block_ids: set[int]
    deadline: float
    active: bool = False  # a session is writing into the blocks
    cancelled: bool = False


class PushReceiver:
    """D's side channel for pushes."""

    def __init__(self, pool: KVPool, stats: KVStats, host: str, port: int, results: queue.SimpleQueue,
                 drain_timeout_s: float = 30.0, secret: bytes = b"") -> None:
        self.pool, self.stats, self.results = pool, stats, results
        self.drain_timeout_s = drain_timeout_s
        self.data = pool.byte_view()
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self.channel = SideChannelServer(host, port, "kv-push-recv", PushBegin, self._session, secret)
        self.host, self.port = host, self.channel.port

    # -- engine thread --------------------------------------------------------------------------

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        with self._lock:
            self._expected[request_id] = _Expected(set(block_ids), time.monotonic() + timeout_s)

    def cancel(self, request_id: str, error: str = "cancelled by the decode node") -> None:
        """Stop accepting layers for the request; its result is reported once nothing writes."""
        with self._lock:
            exp = self._expected.get(request_id)
            if exp is None:
                return
            exp.cancelled = True
            if not exp.active:
                del self._expected[request_id]
                self.results.put(LoadResult(request_id, error, transport="push"))

    def expire(self) -> None:
        """Give up on pushes that did not start or finish in time."""
        now = time.monotonic()
        with self._lock:
            for rid, exp in list(self._expected.items()):
                if now > exp.deadline:
                    if exp.active:
                        exp.cancelled = True  # the session thread reports when it stops
                    else:
                        del self._expected[rid]
                        self.stats.add_failed()
                        self.results.put(LoadResult(rid, "no KV pushed before --kv-wait-timeout", transport="push"))

    # -- session threads ------------------------------------------------------------------------

    def _claim(self, begin: PushBegin) -> str | None:
        if begin.layout != self.pool.layout:
            return f"KV layout mismatch: D {self.pool.layout}, P {begin.layout}"
        if begin.transport == "shm" and self.pool.shm_name is None:
            return "this decode node has no shared-memory KV pool"
        with self._lock:
            exp = self._expected.get(begin.request_id)
            if exp is None or exp.cancelled or exp.active:
                return f"not waiting for a push of request {begin.request_id!r}"
            exp.active = True
        return None

    def _session(self, conn: socket.socket, begin: PushBegin) -> None:
        rid = begin.request_id
        error = self._claim(begin)
        if error:
            send_msg(conn, Ack(ok=False, error=error))
            return
        start, nbytes, error = time.perf_counter(), 0, None
        try:
            # The accept carries our pool size, which an shm pusher needs to map the pool.
            send_msg(conn, Ack(ok=True, pool_num_blocks=self.pool.num_blocks))
            while True:
                msg = recv_msg(conn)
                if isinstance(msg, PushDone):
                    error = None if msg.ok else (msg.error or "push abandoned by the prefill node")
                    if begin.transport == "shm":
                        nbytes = msg.nbytes
                    break
                if not isinstance(msg, PushLayer) or begin.transport != "tcp":
                    raise ProtocolError(f"unexpected {type(msg).__name__} in a push session")
                with self._lock:
                    exp = self._expected[rid]
                    if exp.cancelled:
                        raise ProtocolError("push cancelled by the decode node")
                    if not set(msg.block_ids) <= exp.block_ids or not 0 <= msg.layer < self.pool.num_layers:
                        raise ProtocolError("push names blocks or a layer this request does not own")
                nbytes += recv_segments(conn, self.data, self.pool.segments(msg.block_ids, range(msg.layer, msg.layer + 1)))
        except (OSError, ProtocolError) as exc:
            error = str(exc)
            try:
                send_msg(conn, Ack(ok=False, error=error))  # P sees it before its next layer
                # P may be copying into our shared pool right now: the blocks are only safe to
                # free once P has closed the session (it stops writing before it closes).
                conn.settimeout(self.drain_timeout_s)
                while conn.recv(1 << 16):
                    pass
            except OSError:
                pass
        with self._lock:
            self._expected.pop(rid, None)
        if error is None:
            self.stats.add_received(nbytes, time.perf_counter() - start)
            self.results.put(LoadResult(rid, None, time.perf_counter() - start, nbytes, "push"))
            send_msg(conn, Ack(ok=True))
        else:
            self.stats.add_failed()
            self.results.put(LoadResult(rid, error, transport="push"))

    def close(self) -> None:
        self.channel.close()
