"""Pull mode, worker side: P serves held blocks to D over the side channel; D loads them.

P (`KVSender`): a TCP server on `--kv-host`/`--kv-port`. For each `PullRequest` it pins the held
request (so expiry cannot free blocks mid-copy), serves the blocks over the transport D named,
waits for `PullDone` and releases the hold.

D (`KVReceiver`): loads run on a small thread pool, never on the engine thread; each lands bytes
straight into the request's pre-allocated blocks and reports a `TransferResult` to the inbox.

With tensor parallelism both ends address every TP rank's pool (all in shared memory on the node's
host), and one pull moves each rank's share of the heads by the read plan (kv/tp_plan.py).
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve import tracing
from pdserve.kv.channel import SideChannelServer, connect
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferInbox, TransferResult
from pdserve.kv.params import join_tables
from pdserve.kv.prefix_hash import prompt_digest
from pdserve.kv.leases import LeaseRenewer
from pdserve.kv.protocol import (Ack, ProtocolError, PullDone, PullReply, PullRequest, Renew, check_digests,
                               recv_msg, send_msg)
from pdserve.kv.stats import KVStats
from pdserve.kv.transport import NodeTransports, PeerAddress, PeerPool, Transport, choose_transport

logger = logging.getLogger(__name__)


class KVSender:
    """P's side channel server."""

    def __init__(self, transports: NodeTransports, held: HeldBlocks, stats: KVStats, host: str, port: int,
                 secret: bytes = b"", engine_id: str | None = None) -> None:
        self.transports, self.held, self.stats = transports, held, stats
        self.engine_id = engine_id  # this engine's (new at every start): a pull naming another is refused
        self.channel = SideChannelServer(host, port, "kv-sender", (PullRequest, PullDone, Renew), self._serve, secret)
        self.host, self.port = host, self.channel.port

    def _serve(self, conn: socket.socket, req: PullRequest | PullDone | Renew) -> None:
        if isinstance(req, Renew):  # a D has these requests and is still coming for them
            send_msg(conn, Ack(ok=self.held.renew(req.request_ids) == len(req.request_ids)))
            return
        if isinstance(req, PullDone):  # opening with PullDone: D drops the request without pulling
            send_msg(conn, Ack(ok=self.held.release(req.request_id)))
            return
        serving = self.transports.to_serve(req.transport, req.layout, req.tp_size, producer=True)
        if isinstance(serving, str):
            error = serving
        elif req.engine_id is not None and self.engine_id is not None and req.engine_id != self.engine_id:
            error = (f"the KV was prefilled by engine {req.engine_id}; this prefill node is engine "
                     f"{self.engine_id} (restarted since)")
        else:
            error = self.held.pin(req.request_id, join_tables(req.block_ids), req.num_tokens, req.tokens_digest)
        if error:
            send_msg(conn, PullReply(ok=False, error=error))
            return
        transport, plan = serving
        done, sent = False, 0
        pools = self.transports
        span = None
        if tracing.enabled() and req.traceparent:
            span = tracing.start("kv.serve_pull", req.traceparent, req.request_id,
                                 tracing.transfer_attributes(req.block_ids, transport.name))
        try:
            start = time.perf_counter()
            send_msg(conn, PullReply(ok=True, pool_num_blocks=pools.pool.num_blocks, tp_size=pools.tp_size,
                                     handshake=transport.handshake()))
            runs = pools.pool.group_runs(req.num_tokens, req.first_block, len(req.block_ids[0]))
            sent = sum(transport.serve_read(conn, piece, req.block_ids[group][skip:], slots)
                       for piece in plan for group, slots, skip in runs)
            reply = recv_msg(conn)
            done = isinstance(reply, PullDone) and reply.ok
            # Of the bytes D now has, while the hold still pins them (D computes its own meanwhile).
            digests = pools.digests(plan, runs, req.block_ids) if done and req.want_digests else None
        finally:
            self.held.unpin(req.request_id, done)
            if span is not None:
                tracing.end(span, attributes={"pdserve.kv.bytes": sent}, error=None if done else "D did not finish")
        if done:
            self.stats.add_sent(sent, time.perf_counter() - start, transport.name)
            send_msg(conn, Ack(digests=digests))

    def close(self) -> None:
        self.channel.close()


@dataclass
class LoadSpec:
    """One request's blocks to fetch from a P."""

    request_id: str  # D's request id
    local_block_ids: list[list[int]]  # a table per KV group, all equally long
    remote_block_ids: list[list[int]]
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_transports: tuple[str, ...] = ()  # those P serves (none named: tcp)
    num_tokens: int = 0  # the sequence's KV ends here once loaded (0: every group takes every block)
    first_block: int = 0  # each table's first entry is this block of the sequence
    # D's prompt (the request's own list): the pull names its first num_tokens tokens' digest, which
    # P checks; computed on the load thread, never on the engine's (nor in the simulator).
    prompt_token_ids: list[int] | None = None
    remote_engine_id: str | None = None  # the P engine that prefilled them
    traceparent: str | None = None  # D's request span (tracing on): the pull's span is its child


class KVReceiver:
    """D's loader."""

    def __init__(self, transports: NodeTransports, stats: KVStats, inbox: TransferInbox, transport: str,
                 timeout_s: float, secret: bytes = b"", max_workers: int = 4, verify_digests: bool = False,
                 leases: LeaseRenewer | None = None) -> None:
        self.transports, self.stats, self.inbox = transports, stats, inbox
        self.leases = leases  # renews P's holds of admitted requests until their load ends
        self.transport = transport  # auto or a registered name
        self.verify_digests = verify_digests  # compare the blocks' digests with P's (--kv-verify-digest)
        self.secret = secret
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-load")

    def start(self, spec: LoadSpec) -> None:
        self._executor.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        name = choose_transport(self.transport, PeerAddress(spec.remote_host, spec.remote_transports))
        span = None
        if tracing.enabled():
            span = tracing.start("kv.pull", spec.traceparent, spec.request_id,
                                 tracing.transfer_attributes(spec.remote_block_ids, name))
        start = time.perf_counter()
        try:
            nbytes = self._pull(spec, self.transports[name], span and tracing.traceparent_of(span))
        except Exception as exc:  # noqa: BLE001 - any failure is reported, never raised on a pool thread
            logger.warning("KV load of %s from %s:%s failed: %s", spec.request_id, spec.remote_host, spec.remote_port, exc)
            self.stats.add_failed()
            self.inbox.put(TransferResult(spec.request_id, f"{type(exc).__name__}: {exc}", "pull", name))
            if span is not None:
                tracing.end(span, error=f"{type(exc).__name__}: {exc}")
            return
        finally:
            self._untrack(spec)  # loaded or failed: the hold needs no more renewing
        seconds = time.perf_counter() - start
        self.stats.add_received(nbytes, seconds, name)
        self.inbox.put(TransferResult(spec.request_id, None, "pull", name, seconds, nbytes))
        if span is not None:
            tracing.end(span, attributes={"pdserve.kv.bytes": nbytes})

    def _pull(self, spec: LoadSpec, transport: Transport, traceparent: str | None = None) -> int:
        with connect(spec.remote_host, spec.remote_port, self.timeout_s, self.secret) as sock:
            pools = self.transports
            digest = None if spec.prompt_token_ids is None else prompt_digest(spec.prompt_token_ids, spec.num_tokens)
            send_msg(sock, PullRequest(spec.remote_request_id, spec.remote_block_ids, transport.name, pools.pool.layout,
                                       pools.tp_size, spec.num_tokens, spec.first_block, digest,
                                       spec.remote_engine_id, self.verify_digests, traceparent))
            reply = recv_msg(sock)
            if not isinstance(reply, PullReply) or not reply.ok:
                raise ProtocolError(getattr(reply, "error", None) or "unexpected reply")
            peer = PeerPool(spec.remote_host, reply.pool_num_blocks, reply.tp_size, reply.handshake)
            runs = pools.pool.group_runs(spec.num_tokens, spec.first_block, len(spec.local_block_ids[0]))
            # Every D rank's share, piece by piece, over this one connection: PullDone means all have it.
            plan = pools.pieces(reply.tp_size, producer=False)
            nbytes = sum(transport.read(sock, peer, piece, spec.remote_block_ids[group][skip:],
                                        spec.local_block_ids[group][skip:], slots)
                         for piece in plan for group, slots, skip in runs)
            send_msg(sock, PullDone(spec.remote_request_id))
            ours = pools.digests(plan, runs, spec.local_block_ids) if self.verify_digests else None
            ack = recv_msg(sock)
            if not isinstance(ack, Ack):
                raise ProtocolError("P did not acknowledge the pull")
            if ours is not None:
                check_digests(ours, ack.digests, "prefill node")
            return nbytes

    def _untrack(self, spec: LoadSpec) -> None:
        if self.leases is not None:
            self.leases.untrack(spec.request_id)

    def release(self, spec: LoadSpec) -> None:
        """Tell P (in the background) that this request will never pull, so it frees its hold."""
        self._untrack(spec)
        self._executor.submit(self._release, spec)

    def _release(self, spec: LoadSpec) -> None:
        try:
            with connect(spec.remote_host, spec.remote_port, self.timeout_s, self.secret) as sock:
                send_msg(sock, PullDone(spec.remote_request_id))
                recv_msg(sock)
        except (OSError, ProtocolError) as exc:  # P gone: its hold times out on its own
            logger.info("releasing %s on %s:%s failed: %s", spec.remote_request_id, spec.remote_host,
                        spec.remote_port, exc)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
