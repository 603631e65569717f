"""Colocated: plain load balancing over `--role both` nodes; one node serves the whole request."""

from __future__ import annotations

import httpx
from fastapi.responses import Response

from pdserve.proxy.client import header_seconds
from pdserve.proxy.flows.base import ClientRequest, Flow
from pdserve.proxy.timing import RequestTiming


class ColocatedFlow(Flow):
    name = "colocated"

    async def serve(self, req: ClientRequest) -> Response:
        return await self.on_some_node("decode", req, lambda node: self.answer(node, self.ask(node, req, req.body), req))

    def split_stages(self, response: httpx.Response, timing: RequestTiming) -> None:
        """One node did it all: take its own queue and prefill split."""
        timing.node_queue_s = header_seconds(response, "x-pdserve-queue-ms")
        timing.prefill_s = max(header_seconds(response, "x-pdserve-ttft-ms") - timing.node_queue_s, 0.0)
        timing.prefill_done = timing.arrival + timing.node_queue_s + timing.prefill_s
        timing.transfer_s = header_seconds(response, "x-pdserve-kv-load-ms")
