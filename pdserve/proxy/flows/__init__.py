"""Proxy flows by mode. A new flow is one module with a `Flow` subclass plus one line here."""

from __future__ import annotations

import importlib

from pdserve.proxy.flows.base import ClientRequest, Flow

FLOWS: dict[str, str] = {
    "pull": "pdserve.proxy.flows.pull:PullFlow",
    "push": "pdserve.proxy.flows.push:PushFlow",
    "colocated": "pdserve.proxy.flows.colocated:ColocatedFlow",
    "auto": "pdserve.proxy.flows.auto:AutoFlow",
}

__all__ = ["FLOWS", "ClientRequest", "Flow", "flow_class"]


def flow_class(mode: str) -> type[Flow]:
    if mode not in FLOWS:
        raise ValueError(f"mode must be one of {', '.join(FLOWS)}, got {mode!r}")
    module, cls = FLOWS[mode].split(":")
    return getattr(importlib.import_module(module), cls)
