"""Colocated: plain load balancing over `--role both` nodes; one node serves the whole request."""

from __future__ import annotations

import httpx
from fastapi.responses import Response

from pdserve.proxy.flows.base import ClientRequest, Flow
from pdserve.proxy.timing import RequestTiming


class ColocatedFlow(Flow):
    name = "colocated"
    roles = ("both",)

    async def serve(self, req: ClientRequest) -> Response:
        return await self.on_some_node("decode", req, lambda node: self.answer(node, self.ask(node, req, req.body), req))

    def split_stages(self, response: httpx.Response, timing: RequestTiming) -> None:
        self.split_stages_one_node(response, timing)
