"""Proxy flows by mode (`--mode`). A new flow is one module with a `Flow` subclass (its `name` and the
node `roles` it routes to) plus one line here, or a `FLOWS.register` call from a plugin module."""

from __future__ import annotations

from pdserve.proxy.flows.base import ClientRequest, Flow
from pdserve.registry import Registry

FLOWS: Registry[Flow] = Registry("mode", {
    "pull": "pdserve.proxy.flows.pull:PullFlow",
    "push": "pdserve.proxy.flows.push:PushFlow",
    "colocated": "pdserve.proxy.flows.colocated:ColocatedFlow",
    "auto": "pdserve.proxy.flows.auto:AutoFlow",
})

__all__ = ["FLOWS", "ClientRequest", "Flow"]
