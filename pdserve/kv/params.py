"""`kv_transfer_params`: the proxy's instructions to a node, and P's answer, as one typed schema.

Field names are vLLM's on the wire (NixlConnector / vllm-ascend's Mooncake connectors), so that
vLLM's toy proxy drives pdserve nodes unchanged; `kv_mode`, `remote_first_block`, `metaserver`
and `proxy_request_id` are the layer-wise push extension. The proxy builds them with the
constructors below, the node parses them with `parse` (a 400 naming the field on a bad value),
and the connector reads the fields it needs with `require`.

  pull, proxy -> P   do_remote_decode
  pull, P -> proxy   do_remote_prefill, remote_request_id, remote_block_ids, remote_host,
                     remote_transports, ...,
                     first_token_id (the token P sampled: D decodes from it, computing no prompt token)
  pull, proxy -> D   P's answer as it came
  push, proxy -> D   do_remote_prefill, kv_mode=push, metaserver, proxy_request_id
  push, D -> proxy   (POST metaserver) proxy_request_id, remote_request_id, remote_block_ids, ...,
                     send_first_token (D decodes from P's first token: push the whole prompt)
  push, proxy -> P   do_remote_decode, kv_mode=push, D's remote_* fields and send_first_token
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from pdserve.sampling_params import InvalidParameter

BlockId = Annotated[int, msgspec.Meta(ge=0)]
PUSH = "push"


class KVTransferParams(msgspec.Struct, kw_only=True):
    do_remote_prefill: bool = False  # D: this prompt's KV comes from a prefill node
    do_remote_decode: bool = False  # P: the request is decoded elsewhere; keep (or push) its KV
    kv_mode: str | None = None  # "push" for layer-wise push; pull otherwise
    remote_engine_id: str | None = None
    remote_request_id: str | None = None  # the peer's request id (P's in pull, D's in push)
    # The peer's blocks for the prompt, from block 0; with several KV groups (sliding-window
    # layers, models/kv_spec.py) each group's table in turn, all equally long.
    remote_block_ids: list[BlockId] | None = None
    remote_host: str | None = None  # the peer's KV side channel
    remote_port: int | None = None
    # The KV transports the peer's side channel serves (kv/transport/: shm, tcp, ...); what each
    # needs of the peer travels in its handshake on the side channel. Absent: tcp alone.
    remote_transports: list[str] | None = None
    remote_lease_s: float | None = None  # pull: P's lease on the held blocks, which D renews (kv/holds.py)
    remote_first_block: int | None = None  # push: D already holds the blocks before this one
    metaserver: str | None = None  # push: where D announces its blocks (the proxy's /v1/kv/meta)
    proxy_request_id: str | None = None  # push: the proxy's id, to match D's announcement
    # pull, P -> D: the first output token P sampled. D then loads the whole prompt's KV and
    # decodes from this token; without it D computes the last prompt token itself, a prefill row
    # (the dense weights) in a step its streams wait for.
    first_token_id: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # push, D -> P (D sets it on its own request when its sampling allows): push the KV of the
    # whole prompt and end the push with the first output token P sampled, which D decodes from.
    send_first_token: bool | None = None
    tp_size: int = 1
    # W3C trace context of the node's request span (pdserve/tracing.py; set by the node itself when
    # tracing is on): the side channel carries it on, so the transfer's spans join the request's trace.
    traceparent: str | None = None

    @property
    def is_push(self) -> bool:
        return self.kv_mode == PUSH

    def require(self, *names: str) -> None:
        """InvalidParameter naming the first of `names` that is missing."""
        for name in names:
            if getattr(self, name) is None:
                raise InvalidParameter("kv_transfer_params", f"kv_transfer_params.{name} is required here")

    def to_wire(self) -> dict[str, Any]:
        """The JSON object, without the fields that are not set."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    # -- what the proxy sends ---------------------------------------------------------------------

    @classmethod
    def pull_prefill(cls) -> KVTransferParams:
        return cls(do_remote_decode=True)

    @classmethod
    def push_decode(cls, metaserver: str, proxy_request_id: str) -> KVTransferParams:
        return cls(do_remote_prefill=True, kv_mode=PUSH, metaserver=metaserver, proxy_request_id=proxy_request_id)

    @classmethod
    def push_prefill(cls, announcement: KVTransferParams) -> KVTransferParams:
        """P's instructions from D's announcement: push into D's blocks at D's side channel."""
        remote = {k: v for k, v in msgspec.structs.asdict(announcement).items() if k.startswith("remote_")}
        return cls(do_remote_decode=True, kv_mode=PUSH, send_first_token=announcement.send_first_token, **remote)


def parse(raw: dict[str, Any] | None) -> KVTransferParams | None:
    """The typed params from a request body (None when absent); InvalidParameter on a bad field."""
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise InvalidParameter("kv_transfer_params", f"kv_transfer_params: {exc}") from exc


def wants_remote_prefill(params: KVTransferParams | None) -> bool:
    """D: this request's prompt KV comes from a prefill node."""
    return params is not None and params.do_remote_prefill


def given_first_token(params: KVTransferParams | None) -> int | None:
    """D, pull: the first output token P sampled, when D decodes from it (else None)."""
    if params is None or not params.do_remote_prefill or params.is_push:
        return None
    return params.first_token_id


def first_token_from_prefill(params: KVTransferParams, pushed: int | None) -> int | None:
    """D: the first output token P sampled that D decodes from (None: D samples its own). Pull
    carries it in the params P answered with; push, where D asked for it, with the push's end
    (`pushed`)."""
    if params.is_push:
        return pushed if params.send_first_token else None
    return given_first_token(params)


def moves_whole_prompt(params: KVTransferParams) -> bool:
    """The KV of the whole prompt moves (D decodes from P's first token, pull or push); otherwise
    all but the last prompt token's, which D computes for the logits that sample its first token."""
    return given_first_token(params) is not None or (params.is_push and bool(params.send_first_token))


def wants_remote_decode(params: KVTransferParams | None) -> bool:
    """P: this request is decoded elsewhere; keep (or push) its KV for the decode node."""
    return params is not None and params.do_remote_decode


def join_tables(tables: list[list[int]]) -> list[int]:
    """Block tables (one per KV group, equally long) as kv_transfer_params' one flat
    remote_block_ids: the groups' tables one after another (a model without sliding layers has one)."""
    return [b for table in tables for b in table]


def split_tables(block_ids: list[int], num_groups: int) -> list[list[int]]:
    """The inverse of `join_tables` (the length is checked on arrival: a multiple of num_groups)."""
    n = len(block_ids) // num_groups
    return [block_ids[g * n : (g + 1) * n] for g in range(num_groups)]
