"""Layer-wise push (vllm-ascend's MooncakeLayerwiseConnector):

  1. proxy -> D first: `kv_transfer_params: {do_remote_prefill: true, kv_mode: push, metaserver,
     proxy_request_id}`. D reserves blocks and POSTs them to this proxy's `/v1/kv/meta`.
  2. proxy -> P: `max_tokens: 1`, `{do_remote_decode: true, kv_mode: push}` plus D's blocks and
     address. P pushes each layer's KV to D as soon as it is computed, then ends the push.
  3. D decodes; the proxy relays D's answer as in pull.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
from fastapi.responses import Response

from pdserve.kv.params import KVTransferParams
from pdserve.proxy.client import NodeError, header_seconds, upstream_error
from pdserve.proxy.echo import prompt_only
from pdserve.proxy.flows.base import ClientRequest, Flow
from pdserve.proxy.policies import Node, select_prefiller
from pdserve.proxy.timing import RequestTiming, exposed_push_wait


class PushFlow(Flow):
    name = "push"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.config.meta_url:
            raise ValueError("push mode needs the URL of this proxy's meta endpoint")
        self._announcements: dict[str, asyncio.Future[KVTransferParams]] = {}  # proxy request id -> D's blocks

    async def serve(self, req: ClientRequest) -> Response:
        if prompt_only(req.body):  # the scoring call: P computes and reports the prompt, nothing to push
            return await self.on_some_node("prefill", req, lambda p: self.answer(p, self.ask(p, req, req.body), req))
        # Another D means the whole flow again: the new D reserves its own blocks, P pushes into those.
        return await self.on_some_node("decode", req, lambda d: self._push_once(d, req))

    def announce(self, params: KVTransferParams) -> bool:
        future = self._announcements.get(params.proxy_request_id)
        if future is None or future.done():
            return False
        future.set_result(params)
        return True

    def split_stages(self, response: httpx.Response, timing: RequestTiming) -> None:
        """D waited through P's whole prefill: count as transfer only what was exposed after it."""
        kv_wait = header_seconds(response, "x-pdserve-kv-load-ms")
        timing.transfer_s = exposed_push_wait(kv_wait, (timing.prefill_done or timing.arrival) - timing.arrival)

    async def _push_once(self, decoder: Node, req: ClientRequest) -> Response:
        """D first (it reserves blocks and announces them), then P, which pushes layer by layer."""
        proxy_request_id = uuid.uuid4().hex
        announced = asyncio.get_running_loop().create_future()
        self._announcements[proxy_request_id] = announced
        d_params = KVTransferParams.push_decode(self.config.meta_url, proxy_request_id)
        d_answer = self.ask(decoder, req, {**req.body, "kv_transfer_params": d_params.to_wire()})
        try:
            try:
                done, _ = await asyncio.wait({announced, d_answer}, timeout=self.config.meta_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # cancelled (the client left): close D's request, which frees its blocks
                await self.give_up(decoder, d_answer, req)
                raise
            if not done:
                await self.give_up(decoder, d_answer, req)
                raise NodeError(504, upstream_error(504, f"decode node {decoder.url} did not announce its KV "
                                                         "blocks in time"), decoder.url)
            if announced not in done:  # D answered (an error) before announcing: P is not involved
                return await self.answer(decoder, d_answer, req)
            prefiller = select_prefiller(self.members.prefillers, self.prefill_policy, req.tokens)
            try:
                await self.prefill(prefiller, req, KVTransferParams.push_prefill(announced.result()))
            except BaseException:
                await self.give_up(decoder, d_answer, req)  # closing our D request aborts it there
                raise
            return await self.answer(decoder, d_answer, req)
        finally:
            self._announcements.pop(proxy_request_id, None)
