"""Layer-wise push, worker side (vllm-ascend's MooncakeLayerwiseConnector, in pdserve's terms).

P (`PushSender`): `save_kv_layer(layer)` is called from the forward pass right after a layer has
written its KV, and writes that layer of every pushing request into D's blocks over the session's
transport: on a sender thread, so that socket writes overlap the next layers' compute, or right
there when the transport's write is a memcpy (`copies_inline`, cheaper than a thread hand-off).
At the end of the step `wait_for_save()` waits for the sender thread and tells D what the memcpy
transports wrote; a request's last chunk ends its session with `PushDone`, which carries the first
token P sampled (D decodes from it where it asked: then the whole prompt's KV was pushed), and P
frees its blocks.

D (`PushReceiver`): listens on the side channel, accepts a session only for a request it is
waiting for, lands each layer in that request's reserved blocks, and reports the arrival (or the
failure) like a finished load. A D-side abort cancels the session; blocks are freed only once no
session can write into them any more.

With tensor parallelism each layer goes as the read plan's pieces (kv/tp_plan.py), one run of KV
heads from a P rank's pool to a D rank's. Rank 0's hook may push every rank's layer: the layer's
all-reduces have completed, so every rank has written that layer's KV.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve import tracing
from pdserve.kv.channel import SideChannelServer, connect
from pdserve.kv.inbox import TransferInbox, TransferResult
from pdserve.kv.protocol import (
    Ack,
    ProtocolError,
    PushBegin,
    PushDone,
    PushLayers,
    check_digests,
    recv_msg,
    send_msg,
)
from pdserve.kv.prefix_hash import prompt_digest
from pdserve.kv.stats import KVStats
from pdserve.kv.tp_plan import Piece
from pdserve.kv.transport import NodeTransports, PeerAddress, PeerPool, Transport, choose_transport

logger = logging.getLogger(__name__)


@dataclass
class PushTarget:
    """Where a P request's KV goes: D's request, its blocks and its side channel."""

    request_id: str  # D's
    block_ids: list[list[int]]  # D's blocks for the prompt, a table per KV group: block i <-> P's block i
    first_block: int  # D already holds blocks before this one (its prefix cache)
    host: str
    port: int
    transports: tuple[str, ...] = ()  # those D serves (none named: tcp)
    num_tokens: int = 0  # the prompt tokens whose KV P pushes, of this prompt (D checks PushBegin's digest)
    prompt_token_ids: list[int] | None = None
    traceparent: str | None = None  # P's request span (tracing on): the push's span is its child


@dataclass
class SaveSpec:
    """One step's push work for one request: P's blocks -> D's blocks, and whether it is the last."""

    request_id: str  # P's
    target: PushTarget
    src_block_ids: list[list[int]]  # a table per KV group, all equally long
    dst_block_ids: list[list[int]]
    last: bool
    # Sliding groups push only their window of the prompt's KV, which ends at num_tokens (0: every
    # group pushes every block); each table's first entry is block first_block of the sequence.
    num_tokens: int = 0
    first_block: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids[0]) if self.src_block_ids else 0


@dataclass
class _Session:
    target: PushTarget
    sock: socket.socket | None = None
    transport: Transport | None = None
    peer: PeerPool | None = None
    pieces: list[Piece] = field(default_factory=list)  # every D rank's share (kv/tp_plan.py)
    error: str | None = None
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    want_digests: bool = False  # D asked for the pushed blocks' digests at the end
    src_tables: list[dict[int, None]] = field(default_factory=list)  # P's blocks pushed, per group, in order
    span: Any = None  # tracing on: the push's span, ended with the session

    def end_span(self, error: str | None = None) -> None:
        if self.span is not None:
            tracing.end(self.span, attributes={"pdserve.kv.bytes": self.nbytes}, error=error)
            self.span = None


class PushSender:
    """P's pusher. Sessions are opened and ended on the engine thread."""

    def __init__(self, transports: NodeTransports, stats: KVStats, transport: str, timeout_s: float,
                 secret: bytes = b"") -> None:
        self.transports, self.stats = transports, stats
        self.transport = transport  # auto or a registered name
        self.timeout_s = timeout_s
        self.secret = secret
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, _Session] = {}
        self._failed: list[tuple[str, str]] = []
        self._failed_lock = threading.Lock()
        self._step: list[tuple[SaveSpec, _Session]] = []
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
                    self._open(session, spec.request_id)
                except (OSError, ProtocolError) as exc:
                    self._fail(spec.request_id, session, f"cannot push to {spec.target.host}:{spec.target.port}: {exc}")
            self._step.append((spec, session))
            if session.want_digests:  # (a chunk's last, partial block comes again with the next chunk)
                session.src_tables = session.src_tables or [{} for _ in spec.src_block_ids]
                for table, ids in zip(session.src_tables, spec.src_block_ids):
                    table.update(dict.fromkeys(ids))

    def save_kv_layer(self, layer: int) -> None:
        """The forward pass has just written `layer`: push that layer of every pushing request."""
        for spec, session in self._step:
            if session.error or not spec.num_blocks:
                continue
            if session.transport.copies_inline:
                self._push_layer(spec, session, layer)
            else:
                self._tasks.put((self._push_layer, spec, session, layer))

    def wait_for_save(self, sampled: dict[str, int]) -> None:
        """Wait until this step's queued layers are written, then end the sessions of finished
        prompts, each with the first token this step sampled for it (`sampled`, by P's request id)."""
        barrier = threading.Event()
        self._tasks.put((lambda *_: barrier.set(), None, None, None))
        barrier.wait()
        for spec, session in self._step:
            if session.error is None and session.transport.copies_inline and spec.num_blocks:
                self._announce_copied(spec, session)
            if spec.last:
                self._sessions.pop(spec.request_id, None)
                if session.error is None:
                    self._end(session, ok=True, first_token_id=sampled.get(spec.request_id),
                              digests=self._digests(spec, session) if session.want_digests else None)
                    seconds = time.perf_counter() - session.started
                    self.stats.add_sent(session.nbytes, seconds, session.transport.name)
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

    def _open(self, session: _Session, request_id: str) -> None:
        """Connect to D and begin the push of P's `request_id` into D's request."""
        target = session.target
        transport = self.transports[choose_transport(self.transport, PeerAddress(target.host, target.transports))]
        if tracing.enabled():
            session.span = tracing.start("kv.push", target.traceparent, request_id,
                                         tracing.transfer_attributes(target.block_ids, transport.name))
        sock = connect(target.host, target.port, self.timeout_s, self.secret)
        session.sock = sock
        digest = None if target.prompt_token_ids is None else prompt_digest(target.prompt_token_ids, target.num_tokens)
        send_msg(sock, PushBegin(target.request_id, transport.name, self.transports.pool.layout,
                                 self.transports.tp_size, target.num_tokens, digest,
                                 session.span and tracing.traceparent_of(session.span)))
        reply = recv_msg(sock)
        if not isinstance(reply, Ack) or not reply.ok:
            raise ProtocolError(getattr(reply, "error", None) or "push refused")
        try:
            session.pieces = self.transports.pieces(reply.tp_size, producer=True)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        session.transport = transport
        session.peer = PeerPool(target.host, reply.pool_num_blocks, reply.tp_size, reply.handshake)
        session.want_digests = reply.want_digests

    def _run(self) -> None:
        """The sender thread: runs queued layer pushes (and step barriers) in order."""
        while True:
            fn, spec, session, layer = self._tasks.get()
            fn(spec, session, layer)

    def _push_layer(self, spec: SaveSpec, session: _Session, layer: int) -> None:
        if session.error:
            return
        try:
            if _peer_cancelled(session.sock):
                raise ProtocolError("decode node cancelled the push")
            pool = self.transports.pool
            group, slot = pool.layer_slots[layer]
            skip = pool.group_skip(group, spec.num_tokens, spec.first_block, spec.num_blocks)
            if skip == spec.num_blocks:  # a sliding layer: these blocks are before its window
                return
            src, dst = spec.src_block_ids[group][skip:], spec.dst_block_ids[group][skip:]
            if not session.transport.copies_inline:  # the bytes follow the message on the connection
                send_msg(session.sock, PushLayers(slot, 1, dst))
            for piece in session.pieces:
                session.nbytes += session.transport.write(session.sock, session.peer, piece, src, dst,
                                                          range(slot, slot + 1))
        except (OSError, ProtocolError) as exc:
            self._fail(spec.request_id, session, str(exc))

    def _announce_copied(self, spec: SaveSpec, session: _Session) -> None:
        """A memcpy transport wrote every layer of this chunk: one message per KV group (one in all,
        without sliding layers) tells D which blocks."""
        runs = self.transports.pool.group_runs(spec.num_tokens, spec.first_block, spec.num_blocks)
        try:
            for group, slots, skip in runs:
                send_msg(session.sock, PushLayers(slots.start, len(slots), spec.dst_block_ids[group][skip:]))
        except OSError as exc:
            self._fail(spec.request_id, session, str(exc))

    def _digests(self, spec: SaveSpec, session: _Session) -> list[int]:
        """Of every block this session pushed, as D computes them over the blocks it received."""
        tables = [list(table) for table in session.src_tables]
        runs = self.transports.pool.group_runs(spec.num_tokens, session.target.first_block, len(tables[0]))
        return self.transports.digests(session.pieces, runs, tables)

    def _end(self, session: _Session, ok: bool, error: str | None = None, first_token_id: int | None = None,
             digests: list[int] | None = None) -> None:
        try:
            if session.sock is not None:
                send_msg(session.sock, PushDone(ok, error, first_token_id, digests))
                if ok:
                    reply = recv_msg(session.sock)
                    if not isinstance(reply, Ack) or not reply.ok:
                        logger.warning("decode node did not accept the push: %s", getattr(reply, "error", reply))
        except (OSError, ProtocolError) as exc:
            logger.warning("ending push session failed: %s", exc)
        finally:
            session.end_span(None if ok else error or "push abandoned")
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
            session.end_span(error)
            if session.sock is not None:
                session.sock.close()  # D learns it at once, and knows nothing writes any more
                session.sock = None


def _peer_cancelled(sock: socket.socket) -> bool:
    """True if D has sent something (a cancel) or closed: P must stop writing into its blocks.
    Never blocks (a recv on a socket with a timeout would wait for data)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


@dataclass
class _Expected:
    tables: list[list[int]]  # D's blocks to push into, a table per KV group, from block first_block
    deadline: float
    num_tokens: int = 0  # the prompt tokens whose KV the request needs, of this prompt (None: unchecked)
    token_ids: list[int] | None = None
    first_block: int = 0
    active: bool = False  # a session is writing into the blocks
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.block_ids = {b for table in self.tables for b in table}


class PushReceiver:
    """D's side channel for pushes."""

    def __init__(self, transports: NodeTransports, stats: KVStats, inbox: TransferInbox, host: str,
                 port: int, drain_timeout_s: float = 30.0, secret: bytes = b"", verify_digests: bool = False) -> None:
        self.transports, self.stats, self.inbox = transports, stats, inbox
        self.verify_digests = verify_digests  # ask P for the pushed blocks' digests (--kv-verify-digest)
        self.pool = transports.pool
        self.drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self.channel = SideChannelServer(host, port, "kv-push-recv", PushBegin, self._session, secret)
        self.host, self.port = host, self.channel.port

    # -- engine thread --------------------------------------------------------------------------

    def expect(self, request_id: str, tables: list[list[int]], timeout_s: float, num_tokens: int = 0,
               prompt_token_ids: list[int] | None = None, first_block: int = 0) -> None:
        """Take a push into `tables` (D's blocks from block `first_block` of the sequence, a table
        per KV group) of the KV of the first `num_tokens` tokens of `prompt_token_ids`."""
        with self._lock:
            self._expected[request_id] = _Expected(tables, time.monotonic() + timeout_s, num_tokens, prompt_token_ids,
                                                   first_block)

    def cancel(self, request_id: str, error: str = "cancelled by the decode node") -> None:
        """Stop accepting layers for the request; its result is reported once nothing writes."""
        with self._lock:
            exp = self._expected.get(request_id)
            if exp is None:
                return
            exp.cancelled = True
            if not exp.active:
                del self._expected[request_id]
                self.inbox.put(TransferResult(request_id, error, "push"))

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
                        self.inbox.put(TransferResult(rid, "no KV pushed before --kv-wait-timeout", "push"))

    # -- session threads ------------------------------------------------------------------------

    def _claim(self, begin: PushBegin) -> tuple[Transport, list[Piece]] | str:
        """The session's transport and this side's read plan, or why it is refused."""
        serving = self.transports.to_serve(begin.transport, begin.layout, begin.tp_size, producer=False)
        if isinstance(serving, str):
            return serving
        with self._lock:
            exp = self._expected.get(begin.request_id)
            if exp is None or exp.cancelled or exp.active:
                return f"not waiting for a push of request {begin.request_id!r}"
            if exp.token_ids is not None and (begin.num_tokens, begin.tokens_digest) != (
                    exp.num_tokens, prompt_digest(exp.token_ids, exp.num_tokens)):
                return (f"the push is of another prompt than request {begin.request_id!r}'s (its first "
                        f"{begin.num_tokens} tokens; the request needs the KV of its first {exp.num_tokens})")
            exp.active = True
        return serving

    def _session(self, conn: socket.socket, begin: PushBegin) -> None:
        rid = begin.request_id
        claim = self._claim(begin)
        if isinstance(claim, str):
            send_msg(conn, Ack(ok=False, error=claim))
            return
        transport, plan = claim
        start, nbytes, error, first_token = time.perf_counter(), 0, None, None
        span = None
        if tracing.enabled() and begin.traceparent:
            span = tracing.start("kv.receive_push", begin.traceparent, rid, {"pdserve.kv.transport": transport.name})
        try:
            # The accept carries our pools' size, our TP size (the plan) and the transport's
            # handshake (shm: our segments, which the pusher maps).
            send_msg(conn, Ack(ok=True, pool_num_blocks=self.pool.num_blocks, tp_size=self.transports.tp_size,
                               handshake=transport.handshake(), want_digests=self.verify_digests))
            while True:
                msg = recv_msg(conn)
                if isinstance(msg, PushDone):
                    error = None if msg.ok else (msg.error or "push abandoned by the prefill node")
                    first_token = msg.first_token_id
                    if error is None and self.verify_digests:
                        check_digests(self._digests(rid, plan), msg.digests, "prefill node")
                    break
                if not isinstance(msg, PushLayers):
                    raise ProtocolError(f"unexpected {type(msg).__name__} in a push session")
                layers = range(msg.first_layer, msg.first_layer + msg.num_layers)
                with self._lock:
                    exp = self._expected[rid]
                    if exp.cancelled:
                        raise ProtocolError("push cancelled by the decode node")
                    if not set(msg.block_ids) <= exp.block_ids or not (
                            0 <= layers.start and layers and layers.stop <= self.pool.num_layers):
                        raise ProtocolError("push names blocks or layers this request does not own")
                nbytes += sum(transport.serve_write(conn, piece, msg.block_ids, layers) for piece in plan)
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
        if span is not None:
            tracing.end(span, attributes={"pdserve.kv.bytes": nbytes}, error=error)
        if error is None:
            seconds = time.perf_counter() - start
            self.stats.add_received(nbytes, seconds, transport.name)
            self.inbox.put(TransferResult(rid, None, "push", transport.name, seconds, nbytes, first_token))
            send_msg(conn, Ack(ok=True))
        else:
            self.stats.add_failed()
            self.inbox.put(TransferResult(rid, error, "push", transport.name))

    def _digests(self, request_id: str, plan: list[Piece]) -> list[int]:
        """Of every block the request expected, as P computes them over the blocks it pushed."""
        with self._lock:
            exp = self._expected[request_id]
        runs = self.pool.group_runs(exp.num_tokens, exp.first_block, len(exp.tables[0]))
        return self.transports.digests(plan, runs, exp.tables)

    def close(self) -> None:
        self.channel.close()
