"""A plugin module (PDSERVE_PLUGINS=throwaway_recipes) that adds a proxy flow, a routing policy, a
placement rule and a model family to pdserve without touching a pdserve file: the recipes of
docs/architecture.md."""

from __future__ import annotations

from fastapi.responses import Response

from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.registry import MODELS
from pdserve.proxy.flows import FLOWS, ClientRequest, Flow
from pdserve.proxy.placement import PLACEMENT_RULES, Placement, PlacementRule, PromptView
from pdserve.proxy.policies import POLICIES, Node


class StampedFlow(Flow):
    """Colocated serving that stamps each answer with the node that served it."""

    name = "stamped"
    roles = ("both",)

    async def serve(self, req: ClientRequest) -> Response:
        async def attempt(node: Node) -> Response:
            response = await self.answer(node, self.ask(node, req, req.body), req)
            response.headers["x-stamped-by"] = node.url
            return response
        return await self.on_some_node("decode", req, attempt)

    def split_stages(self, response, timing) -> None:
        self.split_stages_one_node(response, timing)


class LastNode:
    """Always the last healthy node listed."""

    def choose(self, nodes: list[Node], tokens: int) -> Node:
        return nodes[-1]


class AlwaysLocal(PlacementRule):
    """Every prompt prefilled where it decodes, on the least busy decode node."""

    name = "always_local"

    def place(self, view: PromptView, prefillers: list[Node], decoders: list[Node], output_tokens: int) -> Placement:
        return view.local(min(decoders, key=lambda d: d.active_requests))




class ScaledEmbeddingLlama(LlamaForCausalLM):
    """A Llama relative with Gemma's rule: embeddings scaled by sqrt(hidden_size)."""

    def embed(self, input_ids):
        return super().embed(input_ids) * self.config.hidden_size**0.5


MODELS.register("throwaway_scaled_llama", ScaledEmbeddingLlama)


FLOWS.register("stamped", StampedFlow)
POLICIES.register("last_node", LastNode)
PLACEMENT_RULES.register("always_local", AlwaysLocal)
MODELS.register("throwaway_scaled_llama", ScaledEmbeddingLlama)
