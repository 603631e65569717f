"""Auto: per request, the decode node and where the prompt is prefilled (proxy/placement.py).

  local:  the decode (or colocated) node gets the client's body and prefills the prompt itself.
  remote: a prefill node prefills it and holds the KV, then the decode node pulls what it does
          not already hold and decodes: the pull flow's two requests.

The proxy tokenizes the prompt as the nodes do to find the blocks each node holds, prices every
option from the profile, and records the choice: x-pdserve-placement (local | remote),
x-pdserve-placement-ms and x-pdserve-predicted-ttft-ms on the answer; pdserve_proxy:placement_total
{choice} and pdserve_proxy:placement_seconds in /metrics.
"""

from __future__ import annotations

import time

import httpx
from fastapi.responses import Response

from pdserve.proxy.client import NodeError
from pdserve.proxy.costs import CostModel
from pdserve.proxy.echo import prompt_only
from pdserve.proxy.flows.base import ClientRequest, Flow, sequences
from pdserve.proxy.membership import Membership
from pdserve.proxy.placement import Placer, pulls
from pdserve.proxy.prompts import PromptTokens
from pdserve.proxy.speed import shared_steps
from pdserve.proxy.timing import RequestTiming
from pdserve.sampling_params import InvalidParameter

DEFAULT_OUTPUT_TOKENS = 128  # what a request that names no max_tokens is expected to produce


class AutoFlow(Flow):
    name = "auto"
    roles = ("prefill", "decode", "both", "kv_both")

    @classmethod
    def check_members(cls, members: Membership) -> None:
        """Decodes on decode (kv_consumer), colocated or kv_both nodes; prefill nodes need a decode
        or kv_both node to pull from them (a colocated node has no KV connector)."""
        if not members.decoders:
            raise ValueError("auto mode needs at least one decode (--decode), colocated (--node) or "
                             "--kv-both node")
        if any(p.role == "prefill" for p in members.prefillers) and not any(pulls(d) for d in members.decoders):
            raise ValueError("auto mode cannot use prefill nodes without a decode or kv_both node to pull their KV "
                             "(colocated --node nodes have no KV connector)")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.config.profile:
            raise ValueError("auto mode needs --profile (make one with `pdserve profile --quick --out profile.json`; "
                             "`pdserve up --mode auto` finds or measures its own)")
        if not self.config.model_dir:
            raise ValueError("auto mode needs the model (--model) to tokenize prompts as the nodes do")
        if self.index is None:
            raise ValueError("auto mode needs the nodes' prefix caches (a PrefixIndex)")
        self.placer = Placer(CostModel.load(self.config.profile), self.index, self.config.placement,
                             self.config.stall_weight, self.config.remote_prefill_threshold, slos=self.config.slos,
                             policy=self.config.policy)
        self.prompts = PromptTokens(self.config.model_dir)

    async def serve(self, req: ClientRequest) -> Response:
        start = time.perf_counter()
        token_ids = self.prompts.of(req.parsed)
        asked = req.body.get("max_completion_tokens") or req.body.get("max_tokens")
        output_tokens = asked if isinstance(asked, int) and asked > 0 else DEFAULT_OUTPUT_TOKENS
        req.tokens = len(token_ids) + output_tokens * sequences(req.body)  # exact prompt tokens, not the estimate
        try:
            first_token_given = req.parsed.to_sampling_params(output_tokens).decodes_from_given_token
        except InvalidParameter:  # the node that gets it answers the 400, naming the field, as in every mode
            first_token_given = False
        failed: set[str] = set()
        while True:
            placement = self.placer.place(token_ids, [p for p in self.members.prefillers if p.url not in failed],
                                          [d for d in self.members.decoders if d.url not in failed], output_tokens,
                                          first_token_given)
            timing = req.timing
            if timing.placement is None:  # the first choice is what placing cost
                timing.placement_s = time.perf_counter() - start
                self.metrics.placed(placement.choice, timing.placement_s)
            timing.placement, timing.predicted_ttft_s = placement.choice, placement.ttft_s
            req.stream = self.placer.dispatched(placement)
            decoder, prefiller = placement.decoder, placement.prefiller
            try:
                body = req.body
                if prefiller is not None and prompt_only(req.body):
                    decoder, prefiller = prefiller, None  # the scoring call: P computes and reports it, alone
                    placement.decoder.drop(req.stream)  # ... and decodes nothing
                    req.stream = None
                if prefiller is not None:
                    decoder.reserve(req.tokens)  # in D's batch to come while P prefills (Node.reserved_requests)
                    try:
                        kv_params = await self.prefill_for_pull(prefiller, req)
                    finally:
                        decoder.unreserve(req.tokens)
                    body = {**req.body, "kv_transfer_params": kv_params}
                    response = await self.decode_pulled(prefiller, kv_params,
                                                        self.answer(decoder, self.ask(decoder, req, body), req))
                else:
                    response = await self.answer(decoder, self.ask(decoder, req, body), req)
                (prefiller or decoder).speed.observe_prefill(
                    timing.prefill_s, placement.prefill_profile_s * shared_steps(timing))
                return response
            except BaseException as exc:
                if req.stream is not None:  # D's answer, if it came, ended it; else it never reached D
                    placement.decoder.drop(req.stream)
                if not isinstance(exc, NodeError):
                    raise
                node = next((n for n in (decoder, prefiller) if n is not None and n.url == exc.node), None)
                if node is None or not exc.retryable:
                    raise
                self._retry_elsewhere(exc, node, failed, self.members.nodes())  # out of rotation, into `failed`

    def split_stages(self, response: httpx.Response, timing: RequestTiming) -> None:
        if timing.placement == "local":
            self.split_stages_one_node(response, timing)
        else:
            super().split_stages(response, timing)
