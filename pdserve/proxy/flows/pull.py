"""Pull (vLLM's NixlConnector / vllm-ascend's MooncakeConnector protocol):

  1. proxy -> P (`select_prefiller`): the client's body, `max_tokens: 1`, not streamed,
     `kv_transfer_params: {do_remote_decode: true}`. P prefills, holds the blocks and answers
     with `kv_transfer_params` saying where they are.
  2. proxy -> D (`select_decoder`): the client's body plus P's `kv_transfer_params`, as P sent
     them. D pulls the KV, decodes, and the proxy relays D's answer chunk by chunk.
"""

from __future__ import annotations

from fastapi.responses import Response

from pdserve.proxy.echo import prompt_only
from pdserve.proxy.flows.base import ClientRequest, Flow
from pdserve.proxy.policies import Node


class PullFlow(Flow):
    name = "pull"

    async def serve(self, req: ClientRequest) -> Response:
        if prompt_only(req.body):  # the scoring call: P computes and reports the prompt, nothing to move
            return await self.on_some_node("prefill", req, lambda p: self.answer(p, self.ask(p, req, req.body), req))
        async def held_on(p: Node) -> tuple[Node, dict]:
            return p, await self.prefill_for_pull(p, req)

        prefiller, kv_params = await self.on_some_node("prefill", req, held_on)
        # Another D may pull the same KV (P holds it until pulled or its lease runs out), or recompute.
        d_body = {**req.body, "kv_transfer_params": kv_params}
        return await self.decode_pulled(prefiller, kv_params, self.on_some_node(
            "decode", req, lambda d: self.answer(d, self.ask(d, req, d_body), req)))
