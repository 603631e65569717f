"""The KV connector, in vLLM's two halves.

Scheduler side (`KVConnectorScheduler`, engine thread): which prompt tokens of a request come from
a remote P, records the blocks reserved for them, hands the worker side the loads to start each
step (`ConnectorMetadata`), and on P decides that a finished request's blocks are held for a D
and returns the `kv_transfer_params` the proxy forwards.

Worker side (`KVConnectorWorker`): registers the KV pool with the transfer backend (P: the side
channel server; D: the loader), starts loads, and reports finished sends and receives.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.engine.request import Request
from pdserve.kv.params import wants_remote_decode, wants_remote_prefill
from pdserve.kv.pool import KVPool
from pdserve.kv.pull import HeldBlocks, KVReceiver, KVSender, LoadResult, LoadSpec
from pdserve.kv.stats import KVStats
from pdserve.sampling_params import InvalidParameter

REQUIRED_REMOTE_FIELDS = {
    "remote_block_ids": list,
    "remote_host": str,
    "remote_port": int,
    "remote_request_id": str,
}


@dataclass
class ConnectorMetadata:
    """What the scheduler side asks the worker side to do this step."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class FinishedTransfers:
    sent: list[tuple[str, bool]] = field(default_factory=list)  # P: (request id, hold expired)
    received: list[LoadResult] = field(default_factory=list)  # D: loads that ended (ok or not)


class KVConnectorScheduler:
    def __init__(self, config: KVTransferConfig, block_size: int, held: HeldBlocks, engine_id: str) -> None:
        self.config = config
        self.block_size = block_size
        self.held = held
        self.engine_id = engine_id
        self.advertised: dict[str, Any] = {}  # host / port / shm name of this P's side channel
        self._pending: list[LoadSpec] = []

    def validate(self, params: dict[str, Any] | None, num_prompt_tokens: int) -> None:
        """Reject kv_transfer_params this node cannot act on (HTTP 400 upstream)."""
        if wants_remote_prefill(params):
            if not self.config.is_consumer:
                raise InvalidParameter("kv_transfer_params", "do_remote_prefill needs a decode node (--role decode)")
            for name, kind in REQUIRED_REMOTE_FIELDS.items():
                if not isinstance(params.get(name), kind) or isinstance(params.get(name), bool):
                    raise InvalidParameter("kv_transfer_params", f"kv_transfer_params.{name} must be a {kind.__name__}")
            blocks = params["remote_block_ids"]
            needed = -(-max(num_prompt_tokens - 1, 0) // self.block_size)
            if len(blocks) < needed or not all(isinstance(b, int) and b >= 0 for b in blocks):
                raise InvalidParameter(
                    "kv_transfer_params", f"remote_block_ids must list {needed} block ids for this prompt"
                )
        if wants_remote_decode(params) and not self.config.is_producer:
            raise InvalidParameter("kv_transfer_params", "do_remote_decode needs a prefill node (--role prefill)")

    # -- D: loads -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int:
        """Prompt tokens, beyond those computed or cached here, whose KV will be loaded from P.

        P computed the whole prompt; D still computes the last prompt token itself, because
        sampling the first output token needs its logits.
        """
        if not wants_remote_prefill(req.kv_transfer_params):
            return 0
        return max(req.num_prompt_tokens - 1 - num_computed_tokens, 0)

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        """Record the blocks just reserved for req's remote tokens as a load to start."""
        params, bs = req.kv_transfer_params, self.block_size
        first = req.num_computed_tokens // bs
        last = -(-(req.num_computed_tokens + num_external_tokens) // bs)
        remote_blocks = params["remote_block_ids"]
        self._pending.append(
            LoadSpec(
                request_id=req.request_id,
                local_block_ids=req.block_ids[first:last],
                remote_block_ids=remote_blocks[first:last],
                remote_request_id=params["remote_request_id"],
                remote_host=params["remote_host"],
                remote_port=params["remote_port"],
                remote_shm_name=params.get("remote_shm_name"),
            )
        )

    def build_connector_meta(self) -> ConnectorMetadata:
        meta, self._pending = ConnectorMetadata(loads=self._pending), []
        return meta

    # -- P: holds -------------------------------------------------------------------------------

    def request_finished(self, req: Request) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks for a D, kv_transfer_params for the proxy) for a finished request."""
        if not (self.config.is_producer and wants_remote_decode(req.kv_transfer_params)):
            return False, None
        if req.status.finish_reason not in ("stop", "length"):
            return False, None  # aborted: nobody will pull
        blocks = req.block_ids[: -(-req.num_prompt_tokens // self.block_size)]
        self.held.hold(req.request_id, blocks)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id,
            "tp_size": 1,
            **self.advertised,
        }


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, held: HeldBlocks, stats: KVStats) -> None:
        self.config = config
        self.held = held
        self.stats = stats
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None

    def register_kv_caches(self, pool: KVPool) -> dict[str, Any]:
        """Attach the pool to the backend; returns what P advertises to D (address, shm name)."""
        if self.config.is_producer:
            self.sender = KVSender(pool, self.held, self.stats, self.config.host, self.config.port)
            return {"remote_host": self.sender.host, "remote_port": self.sender.port, "remote_shm_name": pool.shm_name}
        if self.config.is_consumer:
            self.receiver = KVReceiver(pool, self.stats, self.config.transport, self.config.wait_timeout_s)
        return {}

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        for spec in meta.loads:
            self.receiver.start(spec)

    def get_finished(self) -> FinishedTransfers:
        return FinishedTransfers(
            sent=self.held.pop_releasable() if self.sender else [],
            received=self.receiver.poll() if self.receiver else [],
        )

    def close(self) -> None:
        if self.sender:
            self.sender.close()
        if self.receiver:
            self.receiver.close()


def new_engine_id() -> str:
    return uuid.uuid4().hex[:12]
