"""Model families by the `model_type` of an HF config.json. A new family is one module with its
model class (the CausalLM contract, models/contract.py: its settings in `read_config`, its KV cache
in `kv_cache_spec`) plus one line here, or a `MODELS.register` call from a plugin module."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.config import ModelConfig
from pdserve.models.contract import CausalLM
from pdserve.registry import Registry

MODELS: Registry[CausalLM] = Registry("model_type", {
    "llama": "pdserve.models.llama:LlamaForCausalLM",
    "qwen2": "pdserve.models.llama:LlamaForCausalLM",  # the same decoder, q/k/v bias
    "qwen3": "pdserve.models.llama:LlamaForCausalLM",  # the same decoder, q/k norm
    "deepseek_v3": "pdserve.models.deepseek:DeepseekV3ForCausalLM",  # MLA, MoE
    "gemma3_text": "pdserve.models.gemma3:Gemma3ForCausalLM",  # sliding-window and global layers
})


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return MODELS.get(cfg.model_type)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """A model dir's config.json, read by its family's class; ValueError for an unknown model_type."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return MODELS.get(hf.get("model_type", "llama")).read_config(hf)
