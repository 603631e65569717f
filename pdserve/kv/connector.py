"""The KV connector, in vLLM's two halves.

Scheduler side (`KVConnectorScheduler`, engine thread): which prompt tokens of a request come from
a remote P, records the blocks reserved for them, hands the worker side the loads to start each
step (`ConnectorMetadata`), and on P decides that a finished request's blocks are held for a D
and returns the `kv_transfer_params` the proxy forwards.

Worker side (`KVConnectorWorker`): registers the KV pools with the transfer backend (P: the side
channel server; D: the loader), starts loads, and reports finished sends and receives. It runs on
TP rank 0 and moves every rank's share of the heads: the ranks' pools are in this host's shared
memory, so the other ranks never take part in a transfer, and rank 0 alone decides when a
request's KV has arrived or may be freed.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from pdserve import tracing
from pdserve.config import KVTransferConfig
from pdserve.kv.channel import resolve_secret
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferInbox, TransferResult
from pdserve.kv.leases import Lease, LeaseRenewer
from pdserve.kv.params import (
    KVTransferParams,
    join_tables,
    moves_whole_prompt,
    split_tables,
    wants_remote_decode,
    wants_remote_prefill,
)
from pdserve.kv.pool import KVPool
from pdserve.kv.pull import KVReceiver, KVSender, LoadSpec
from pdserve.kv.push import PushReceiver, PushSender, PushTarget, SaveSpec
from pdserve.kv.stats import KVStats
from pdserve.kv.transport import AUTO, NodeTransports
from pdserve.sampling_params import InvalidParameter

logger = logging.getLogger(__name__)

# The peer's address and blocks: what D needs to pull, and what P needs to push.
PEER_FIELDS = ("remote_request_id", "remote_block_ids", "remote_host", "remote_port")
RENEW_TIMEOUT_S = 5.0  # a renewal P does not take in this long is given up (the next one comes soon)


class ConnectorRequest(Protocol):
    """What the connector reads of an engine request (kv/ sits below engine/ and never imports it)."""

    request_id: str
    kv_transfer_params: KVTransferParams | None
    num_computed_tokens: int
    prompt_token_ids: list[int]
    block_tables: list[list[int]]  # one per KV group (models/kv_spec.py)

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def finish_reason(self) -> str | None: ...


@dataclass
class PushProgress:
    """P, push: where a request's layers go, and the first block not yet fully pushed."""

    target: PushTarget
    next_block: int


@dataclass
class ExpectSpec:
    """D, push mode: blocks reserved for a push, and the proxy to tell where to push."""

    request_id: str
    block_ids: list[list[int]]  # D's blocks for the prompt (all, from block 0), a table per KV group
    first_block: int  # blocks before this one are D's own prefix-cache hits
    metaserver: str
    proxy_request_id: str
    send_first_token: bool | None = None  # D decodes from P's first token: P pushes the whole prompt
    num_tokens: int = 0  # the prompt tokens whose KV the push brings, of this prompt (D checks P's push)
    prompt_token_ids: list[int] | None = None

    def announcement(self, advertised: dict[str, Any]) -> KVTransferParams:
        """What D tells the proxy's meta endpoint: its request, the blocks to push into, and where
        its side channel is (`advertised`); P's instructions are made from it (push_prefill)."""
        return KVTransferParams(proxy_request_id=self.proxy_request_id, remote_request_id=self.request_id,
                                remote_block_ids=join_tables(self.block_ids), remote_first_block=self.first_block,
                                send_first_token=self.send_first_token, **advertised)


@dataclass
class ConnectorMetadata:
    """What the scheduler side asks the worker side to do this step."""

    loads: list[LoadSpec] = field(default_factory=list)  # D, pull: start these loads
    expects: list[ExpectSpec] = field(default_factory=list)  # D, push: announce these
    cancels: list[str] = field(default_factory=list)  # D: requests aborted while waiting for KV
    saves: list[SaveSpec] = field(default_factory=list)  # P, push: layers to push this step
    push_aborts: list[str] = field(default_factory=list)  # P, push: requests that ended early
    releases: list[LoadSpec] = field(default_factory=list)  # D, pull: finished unloaded; P may free its hold
    leases: list[Lease] = field(default_factory=list)  # D, pull: admitted; renew P's hold until loaded


@dataclass
class FinishedTransfers:
    sent: list[tuple[str, bool]] = field(default_factory=list)  # P: (request id, hold expired)
    received: list[TransferResult] = field(default_factory=list)  # D: loads / pushes that ended
    push_failed: list[tuple[str, str]] = field(default_factory=list)  # P: (request id, why)


def remote_tokens(params: KVTransferParams, num_prompt_tokens: int) -> int:
    """The prompt tokens whose KV moves P -> D: all, when D decodes from P's first token; else all but the last."""
    return max(num_prompt_tokens - (0 if moves_whole_prompt(params) else 1), 0)


class KVConnectorScheduler:
    def __init__(self, config: KVTransferConfig, block_size: int, held: HeldBlocks, engine_id: str,
                 group_windows: tuple[int, ...] = (0,)) -> None:
        self.config = config
        self.block_size = block_size
        self.num_groups = len(group_windows)  # the model's KV groups: a block table each (models/kv_spec.py)
        self.held = held
        self.engine_id = engine_id
        self.advertised: dict[str, Any] = {}  # host / port / transports of this node's side channel
        self._pending: list[LoadSpec] = []
        self._expects: list[ExpectSpec] = []
        self._cancels: list[str] = []
        self._push_aborts: list[str] = []
        self._releases: list[LoadSpec] = []  # D, pull: requests that will never pull
        self._leases: list[Lease] = []  # D, pull: requests admitted since the last step
        self._pushing: dict[str, PushProgress] = {}  # P, push: by request id, until it finishes

    def validate(self, params: KVTransferParams | None, num_prompt_tokens: int) -> None:
        """Reject kv_transfer_params this node cannot act on (HTTP 400 upstream)."""
        if params is not None and params.is_push and not self.config.takes_push and (
                wants_remote_prefill(params) or wants_remote_decode(params)):
            raise InvalidParameter("kv_transfer_params", "a kv_both node moves KV by pull only: layer-wise push "
                                   "needs --role prefill and --role decode nodes")
        if wants_remote_prefill(params):
            if not self.config.is_consumer:
                raise InvalidParameter("kv_transfer_params", "do_remote_prefill needs a decode node (--role decode)")
            if params.is_push:
                params.require("metaserver", "proxy_request_id")
            else:
                params.require(*PEER_FIELDS)
                self._require_blocks(params, num_prompt_tokens)
        if wants_remote_decode(params):
            if not self.config.is_producer:
                raise InvalidParameter("kv_transfer_params", "do_remote_decode needs a prefill node (--role prefill)")
            if params.is_push:
                params.require(*PEER_FIELDS, "remote_first_block")
                self._require_blocks(params, num_prompt_tokens)

    def _require_blocks(self, params: KVTransferParams, num_prompt_tokens: int) -> None:
        needed = -(-remote_tokens(params, num_prompt_tokens) // self.block_size)
        ids, groups = len(params.remote_block_ids), self.num_groups
        if ids % groups or ids // groups < needed:
            tables = f" for each of the model's {groups} KV groups, one table after another" if groups > 1 else ""
            raise InvalidParameter("kv_transfer_params",
                                   f"remote_block_ids must list {needed} block ids{tables} for this prompt")

    # -- D: loads -------------------------------------------------------------------------------

    def request_added(self, req: ConnectorRequest) -> None:
        """D admitted req: from now until it pulls, it renews P's lease on the KV (kv/leases.py)."""
        params = req.kv_transfer_params
        if wants_remote_prefill(params) and not params.is_push:
            self._leases.append(Lease(req.request_id, params.remote_request_id, params.remote_host,
                                      params.remote_port, params.remote_lease_s or self.config.lease_s))

    def get_num_new_matched_tokens(self, req: ConnectorRequest, num_computed_tokens: int) -> int:
        """Prompt tokens, beyond those computed or cached here, whose KV will be loaded from P.

        P computed the whole prompt. Given P's first output token, D loads it all and decodes from
        that token; otherwise D computes the last prompt token itself, for the logits that sample it.
        """
        if not wants_remote_prefill(req.kv_transfer_params):
            return 0
        return max(remote_tokens(req.kv_transfer_params, req.num_prompt_tokens) - num_computed_tokens, 0)

    def update_state_after_alloc(self, req: ConnectorRequest, num_external_tokens: int) -> None:
        """Record the blocks just reserved for req's remote tokens: a load (pull) or a push to expect."""
        params, bs = req.kv_transfer_params, self.block_size
        first = req.num_computed_tokens // bs
        last = -(-(req.num_computed_tokens + num_external_tokens) // bs)
        num_tokens = req.num_computed_tokens + num_external_tokens
        if params.is_push:
            self._expects.append(ExpectSpec(req.request_id, [t[:last] for t in req.block_tables], first,
                                            params.metaserver, params.proxy_request_id, params.send_first_token,
                                            num_tokens, req.prompt_token_ids))
            return
        self._pending.append(
            LoadSpec(
                request_id=req.request_id,
                local_block_ids=[t[first:last] for t in req.block_tables],
                remote_block_ids=[t[first:last] for t in split_tables(params.remote_block_ids, self.num_groups)],
                remote_request_id=params.remote_request_id,
                remote_host=params.remote_host,
                remote_port=params.remote_port,
                remote_transports=tuple(params.remote_transports or ()),
                num_tokens=num_tokens,
                first_block=first,
                prompt_token_ids=req.prompt_token_ids,
                remote_engine_id=params.remote_engine_id,
                traceparent=params.traceparent,
            )
        )

    def request_aborted(self, req: ConnectorRequest) -> None:
        """D: the request was aborted while waiting for KV; P: a pushing request ended early."""
        if wants_remote_prefill(req.kv_transfer_params):
            self._cancels.append(req.request_id)
        elif wants_remote_decode(req.kv_transfer_params) and req.kv_transfer_params.is_push:
            self._push_aborts.append(req.request_id)

    def has_pending(self) -> bool:
        return bool(self._pending or self._expects or self._cancels or self._push_aborts or self._releases
                    or self._leases)

    def build_connector_meta(self, scheduled: list | None = None) -> ConnectorMetadata:
        meta = ConnectorMetadata(self._pending, self._expects, self._cancels,
                                 self._saves(scheduled or []), self._push_aborts, self._releases, self._leases)
        self._pending, self._expects, self._cancels, self._push_aborts, self._releases = [], [], [], [], []
        self._leases = []
        return meta

    def _saves(self, scheduled: list) -> list[SaveSpec]:
        """P, push: which blocks each pushing request writes this step (layer by layer)."""
        saves, bs = [], self.block_size
        for s in scheduled:
            req, params = s.request, s.request.kv_transfer_params
            if not (wants_remote_decode(params) and params.is_push):
                continue
            n = req.num_prompt_tokens
            end = req.num_computed_tokens + s.num_new_tokens
            if req.num_computed_tokens >= n:
                continue  # decoding on P: nothing more to push
            progress = self._pushing.get(req.request_id)
            needed = remote_tokens(params, n)
            if progress is None:
                target = PushTarget(params.remote_request_id, split_tables(params.remote_block_ids, self.num_groups),
                                    params.remote_first_block, params.remote_host, params.remote_port,
                                    tuple(params.remote_transports or ()), needed, req.prompt_token_ids,
                                    params.traceparent)
                progress = self._pushing[req.request_id] = PushProgress(target, params.remote_first_block)
            # D needs the KV of tokens [0, needed); the last, partly filled block is sent again
            # with the next chunk, so that every chunk's tokens land.
            useful_end = min(end, needed)
            first, last = progress.next_block, -(-useful_end // bs)
            src = [t[first:last] for t in req.block_tables]
            dst = [t[first:last] for t in progress.target.block_ids]
            progress.next_block = max(first, useful_end // bs)
            saves.append(SaveSpec(req.request_id, progress.target, src, dst, last=end >= n, num_tokens=needed,
                                  first_block=first))
        return saves

    # -- P: holds -------------------------------------------------------------------------------

    def request_finished(self, req: ConnectorRequest) -> tuple[bool, KVTransferParams | None]:
        """(keep the blocks for a D, kv_transfer_params for the proxy) for a finished request."""
        self._pushing.pop(req.request_id, None)
        params = req.kv_transfer_params
        if self.config.is_consumer and wants_remote_prefill(params) and not params.is_push:
            # D: finished before its KV was ever loaded (aborted while queued; a load clears the
            # params): tell P now rather than leave its blocks held until the hold times out.
            self._releases.append(LoadSpec(req.request_id, [], [], params.remote_request_id, params.remote_host,
                                           params.remote_port))
            return False, None
        if not (self.config.is_producer and wants_remote_decode(params)):
            return False, None
        if params.is_push:
            if req.finish_reason not in ("stop", "length"):
                self._push_aborts.append(req.request_id)
            return False, None  # pushed during the forward pass: nothing to hold
        if req.finish_reason not in ("stop", "length"):
            return False, None  # aborted: nobody will pull
        blocks = join_tables([t[: -(-req.num_prompt_tokens // self.block_size)] for t in req.block_tables])
        self.held.hold(req.request_id, blocks, req.prompt_token_ids,
                       params.traceparent if tracing.enabled() else None)
        first = req.output_token_ids[0] if req.output_token_ids else None
        return True, KVTransferParams(do_remote_prefill=True, remote_block_ids=blocks, remote_engine_id=self.engine_id,
                                      remote_request_id=req.request_id, first_token_id=first,
                                      remote_lease_s=self.config.lease_s, **self.advertised)


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, held: HeldBlocks, stats: KVStats, engine_id: str | None = None) -> None:
        self.config = config
        self.held = held
        self.stats = stats
        self.engine_id = engine_id  # P: pulls naming another engine (this P before a restart) are refused
        self.inbox = TransferInbox()  # D: loads and pushes that ended
        self.transports: NodeTransports | None = None
        self.sender: KVSender | None = None
        self.pusher: PushSender | None = None
        self.receiver: KVReceiver | None = None
        self.push_receiver: PushReceiver | None = None
        self.leases: LeaseRenewer | None = None  # D
        self._announcer = ThreadPoolExecutor(2, thread_name_prefix="kv-announce")
        self._http = httpx.Client(timeout=config.wait_timeout_s)  # keep-alive to the proxy

    def register_kv_caches(self, pools: list[KVPool]) -> dict[str, Any]:
        """Attach the pools (one per TP rank) to the transports; returns this node's side channel
        address and TP size, for the peer's kv_transfer_params."""
        kv = self.config
        secret = resolve_secret(kv.secret)
        self.transports = NodeTransports(pools, kv.host)
        if not (kv.is_producer or kv.is_consumer):
            return {}
        if kv.transport != AUTO:  # the one this node drives transfers over: started (pools registered) now
            self.transports[kv.transport]
        # The side channel peers reach: P's (and kv_both's) serves pulls, D's takes pushes.
        if kv.is_producer:
            self.sender = KVSender(self.transports, self.held, self.stats, kv.host, kv.port, secret, self.engine_id)
            channel = self.sender
        if kv.is_consumer:
            self.leases = LeaseRenewer(min(kv.wait_timeout_s, RENEW_TIMEOUT_S), secret)
            self.receiver = KVReceiver(self.transports, self.stats, self.inbox, kv.transport, kv.wait_timeout_s, secret,
                                       verify_digests=kv.verify_digest, leases=self.leases)
        if kv.takes_push and kv.is_producer:
            self.pusher = PushSender(self.transports, self.stats, kv.transport, kv.wait_timeout_s, secret)
        elif kv.takes_push:
            self.push_receiver = PushReceiver(self.transports, self.stats, self.inbox, kv.host, kv.port,
                                              kv.wait_timeout_s, secret, kv.verify_digest)
            channel = self.push_receiver
        return {"remote_host": channel.host, "remote_port": channel.port,
                "remote_transports": list(self.transports.served()), "tp_size": len(pools)}

    def start_load_kv(self, meta: ConnectorMetadata, advertised: dict[str, Any]) -> None:
        for lease in meta.leases:
            self.leases.track(lease)
        for spec in meta.loads:
            self.receiver.start(spec)
        for rid in meta.cancels:
            if self.push_receiver is not None:  # a pull in flight ends on its own (the load then finds no request)
                self.push_receiver.cancel(rid)
        for spec in meta.releases:
            self.receiver.release(spec)
        for spec in meta.expects:
            self.push_receiver.expect(spec.request_id, [t[spec.first_block:] for t in spec.block_ids],
                                      self.config.wait_timeout_s, spec.num_tokens, spec.prompt_token_ids,
                                      spec.first_block)
            self._announcer.submit(self._announce, spec, advertised)
        for rid in meta.push_aborts:
            self.pusher.abort(rid)
        if self.pusher is not None:
            self.pusher.begin_step(meta.saves)

    def _announce(self, spec: ExpectSpec, advertised: dict[str, Any]) -> None:
        """Tell the proxy's meta endpoint where P should push (D's request, blocks, address)."""
        body = spec.announcement(advertised)
        try:
            response = self._http.post(spec.metaserver, json=body.to_wire())
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("announcing %s to %s failed: %s", spec.request_id, spec.metaserver, exc)
            self.push_receiver.cancel(spec.request_id, f"could not reach the proxy's meta endpoint: {exc}")

    def save_kv_layer(self, layer: int) -> None:
        self.pusher.save_kv_layer(layer)

    def wait_for_save(self, sampled: dict[str, int]) -> None:
        self.pusher.wait_for_save(sampled)

    def get_finished(self) -> FinishedTransfers:
        if self.push_receiver is not None:
            self.push_receiver.expire()
        return FinishedTransfers(
            sent=self.held.pop_releasable() if self.sender else [],
            received=self.inbox.poll(),
            push_failed=self.pusher.failed_requests() if self.pusher else [],
        )

    def close(self) -> None:
        self._announcer.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        for part in (self.sender, self.receiver, self.push_receiver, self.leases):
            if part is not None:
                part.close()
        if self.transports is not None:
            self.transports.close()


def new_engine_id() -> str:
    return uuid.uuid4().hex[:12]
