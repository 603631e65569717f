"""Model classes by the `architectures` name of an HF config.json. A new model family is one
module with its model class (a `kv_cache_spec` classmethod and the forward the runner calls)
plus one line here."""

from __future__ import annotations

import importlib

from torch import nn

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "pdserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pdserve.models.llama:LlamaForCausalLM",  # the same decoder, q/k/v bias
    "Qwen3ForCausalLM": "pdserve.models.llama:LlamaForCausalLM",  # the same decoder, q/k norm
    "DeepseekV3ForCausalLM": "pdserve.models.deepseek:DeepseekV3ForCausalLM",  # MLA, MoE
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; known: {', '.join(ARCHITECTURES)}")
    module, cls = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
