"""One configurable Llama-family decoder: Llama / SmolLM2, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Its attention is one fused QKV projection over the K/V paged attention (models/attention.py); the
rest is the shared layers (models/layers.py) in the shared decoder (models/decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionMetadata, paged_attention
from pdserve.models.decoder import DecoderLM
from pdserve.models.kv_spec import KVCacheSpec
from pdserve.models.layers import (
    MLP,
    DecoderLayer,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    Rotation,
    Yarn,
    load_mlp,
    row_parallel,
    rows_of,
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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        variant = LlamaVariant.of(cfg)
        self.tp = tp  # this rank's heads only; o_proj's partial sums are all-reduced
        self.num_heads, self.num_kv_heads = len(tp.heads(cfg.num_heads)), len(tp.kv_heads(cfg.num_kv_heads))
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=variant.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=variant.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if variant.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rotate: Rotation, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x, meta.num_decodes)
        num_tokens, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = rotate(qk)  # q and k heads rotated in one pass
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.flatten(1), meta.num_decodes))


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
        layers = (DecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, Attention(cfg, tp),
                               MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp))
                  for _ in range(cfg.num_layers))
        super().__init__(cfg, tp, layers,
                         RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions, Yarn.from_config(cfg)))

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights: this rank's slices (TP), q/k/v and gate/up fused into this model's
        projections."""
        own = self.own_names(weights)
        cfg, tp = self.config, self.tp
        q, kv = rows_of(tp.heads(cfg.num_heads), cfg.head_dim), rows_of(tp.kv_heads(cfg.num_kv_heads), cfg.head_dim)
        mlp = rows_of(tp.rows(cfg.intermediate_size), 1)
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            for suffix in ("weight", "bias"):
                parts = [own.pop(f"{p}self_attn.{n}_proj.{suffix}", None) for n in "qkv"]
                if parts[0] is not None:  # column-parallel: this rank's heads
                    own[f"{p}self_attn.qkv_proj.{suffix}"] = torch.cat((parts[0][q], parts[1][kv], parts[2][kv]))
            load_mlp(own, f"{p}mlp.", mlp, tp)
            row_parallel(own, f"{p}self_attn.o_proj", q, tp)
        self.load_own_state_dict(own)
