"""Reading vLLM-style `kv_transfer_params` (the proxy's instructions to a node)."""

from __future__ import annotations

from typing import Any


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """D: this request's prompt KV comes from a prefill node."""
    return bool(params and params.get("do_remote_prefill"))


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """P: this request is decoded elsewhere; keep its KV for the decode node."""
    return bool(params and params.get("do_remote_decode"))


def is_push(params: dict[str, Any] | None) -> bool:
    """Layer-wise push (P writes into D's blocks) rather than pull (D reads P's)."""
    return bool(params and params.get("kv_mode") == "push")
