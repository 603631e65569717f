"""One configurable Llama-family decoder: Llama / SmolLM2, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

All of it is the shared layers (models/layers.py: the fused-QKV attention over the K/V paged
attention, the SiLU MLP) in the shared decoder (models/decoder.py); `LlamaVariant` says what a
relative changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import ModelConfig
from pdserve.models.decoder import DecoderLM
from pdserve.models.kv_spec import KVCacheSpec
from pdserve.models.layers import (
    MLP,
    DecoderLayer,
    QKVAttention,
    RotaryEmbedding,
    Yarn,
    load_fused_qkv_layers,
)
from pdserve.models.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class LlamaVariant:
    """What Llama's relatives change, by their model_type: q/k/v bias (Qwen2 always, the others with
    attention_bias), o_proj bias (attention_bias, never Qwen2's), q/k norm per head (Qwen3). A
    relative of another model_type follows Llama's rules."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, cfg: ModelConfig) -> LlamaVariant:
        bias = bool(cfg.hf.get("attention_bias", False))
        return cls(qkv_bias=cfg.model_type == "qwen2" or bias, o_bias=cfg.model_type != "qwen2" and bias,
                   qk_norm=cfg.model_type == "qwen3")


class LlamaForCausalLM(DecoderLM):
    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf_dict(hf)

    @classmethod
    def kv_cache_spec(cls, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> KVCacheSpec:
        """K and V of every layer, per KV head this rank holds (what paged_attention reads and writes)."""
        return KVCacheSpec(cfg.num_layers, len(tp.kv_heads(cfg.num_kv_heads)), cfg.head_dim, dtype,
                           model_kv_heads=cfg.num_kv_heads)

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        tp.check(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        variant = LlamaVariant.of(cfg)
        layers = (DecoderLayer(cfg.hidden_size, cfg.rms_norm_eps,
                               QKVAttention(cfg, tp, variant.qkv_bias, variant.o_bias, variant.qk_norm),
                               MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp))
                  for _ in range(cfg.num_layers))
        super().__init__(cfg, tp, layers,
                         RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions, Yarn.from_config(cfg)))

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights: this rank's slices (TP), q/k/v and gate/up fused into this model's
        projections."""
        own = self.own_names(weights)
        load_fused_qkv_layers(own, self.config, self.tp)
        self.load_own_state_dict(own)
