"""Gemma 3 (text, `gemma3_text`): interleaved sliding-window (local) and global attention layers.

What differs from a Llama, each on the shared layers (models/layers.py):
- layer kinds from `layer_types`: a "sliding_attention" layer attends to the last `sliding_window`
  positions only and rotates with its own RoPE base (`rope_local_base_freq`, 10k); a
  "full_attention" layer sees the whole context and rotates with `rope_theta` (1M);
- four norms a layer (the attention's and the MLP's outputs are normed before the residual add)
  and q / k norms per head; Gemma's RMSNorm scales by (1 + w), so the loader stores 1 + w in the
  shared RMSNorm (C++ kernel included);
- GeGLU (tanh-approximated GELU) MLP; the embedding scaled by sqrt(hidden_size); the softmax scale
  1 / sqrt(query_pre_attn_scalar); tied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionMetadata
from pdserve.models.decoder import DecoderLM
from pdserve.models.kv_spec import KVCacheSpec
from pdserve.models.layers import MLP, QKVAttention, RMSNorm, RotaryEmbedding, Rotation, load_fused_qkv_layers
from pdserve.models.parallel import SINGLE, TensorParallel

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Settings:
    """The fields of a Gemma 3 text config.json beyond a Llama's."""

    layer_types: tuple[str, ...]
    sliding_window: int
    local_rope_theta: float
    query_pre_attn_scalar: float

    @classmethod
    def of(cls, cfg: ModelConfig) -> Gemma3Settings:
        hf = cfg.hf
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise ValueError(f"Gemma 3 with {key} is not supported (Gemma 3 checkpoints leave it null)")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (an embedding model)")
        if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 hidden_activation {hf['hidden_activation']!r}: only gelu_pytorch_tanh")
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        types = hf.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(cfg.num_layers)]
        if len(types) != cfg.num_layers or not set(types) <= {FULL, SLIDING}:
            raise ValueError(f"Gemma 3 layer_types must name {FULL} or {SLIDING} for each of its "
                             f"{cfg.num_layers} layers, got {types}")
        rope = hf.get("rope_parameters") or {}
        for kind in (FULL, SLIDING):
            rope_type = (rope.get(kind) or {}).get("rope_type", "default")
            if rope_type != "default":
                raise ValueError(f"Gemma 3 {kind} layers with rope type {rope_type!r}: only plain RoPE is supported")
        local = (rope.get(SLIDING) or {}).get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
        return cls(tuple(types), int(hf.get("sliding_window") or 4096), float(local),
                   float(hf.get("query_pre_attn_scalar", cfg.head_dim)))

    def window(self, layer: int) -> int:
        """The layer's attention window (0: the whole context)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0


class Gemma3DecoderLayer(nn.Module):
    """The attention's and the MLP's outputs are each normed before they join the residual stream."""

    def __init__(self, cfg: ModelConfig, settings: Gemma3Settings, tp: TensorParallel, index: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = QKVAttention(cfg, tp, qk_norm=True, scale=settings.query_pre_attn_scalar**-0.5,
                                      window=settings.window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, False, tp, activation="gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None, rotate: Rotation, kv_cache,
                meta: AttentionMetadata) -> torch.Tensor:
        """As the shared DecoderLayer: adds the previous layer's `delta` into the residual stream (in
        place, fused with the norm) and returns this layer's, the MLP's normed output."""
        h = self.input_layernorm(residual) if delta is None else self.input_layernorm(delta, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rotate, kv_cache, meta))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, meta.num_decodes))


class Gemma3ForCausalLM(DecoderLM):
    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        rope = (hf.get("rope_parameters") or {}).get(FULL) or {}
        theta = hf.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        cfg = ModelConfig.from_hf_dict({**hf, "rope_parameters": None}, rope_theta=float(theta),
                                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))
        Gemma3Settings.of(cfg)  # an unsupported variant fails here, before any weight loads
        return cfg

    @classmethod
    def kv_cache_spec(cls, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> KVCacheSpec:
        """K and V of every layer, per KV head this rank holds, and each layer's window. The pool
        keeps every position of every layer for now; the sliding layers read their window only."""
        settings = Gemma3Settings.of(cfg)
        return KVCacheSpec(cfg.num_layers, len(tp.kv_heads(cfg.num_kv_heads)), cfg.head_dim, dtype,
                           model_kv_heads=cfg.num_kv_heads,
                           layer_windows=tuple(settings.window(i) for i in range(cfg.num_layers)))

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        tp.check(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        settings = Gemma3Settings.of(cfg)
        layers = (Gemma3DecoderLayer(cfg, settings, tp, i) for i in range(cfg.num_layers))
        super().__init__(cfg, tp, layers, RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions))
        self.settings = settings
        self.local_rope = RotaryEmbedding(cfg.head_dim, settings.local_rope_theta, max_positions)
        # sqrt(hidden_size) rounded to float32, as transformers' scaled embedding keeps it.
        self.embed_scale = float(np.float32(cfg.hidden_size**0.5))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Gemma scales its embeddings by sqrt(hidden_size)."""
        return self.embed_tokens(input_ids).float() * self.embed_scale

    def rotations(self, positions: torch.Tensor) -> list[Rotation]:
        """The sliding layers rotate with their own base."""
        full = self.rope.rotation(positions, self.compute_dtype)
        local = self.local_rope.rotation(positions, self.compute_dtype)
        return [local if self.settings.window(i) else full for i in range(len(self.layers))]

    def reset_buffers(self, device: torch.device | str) -> None:
        super().reset_buffers(device)
        self.local_rope.reset_tables(device)

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """HF names: this rank's heads and MLP rows (TP), q/k/v and gate/up fused; every norm's
        weight stored as 1 + w (Gemma's RMSNorm scales by it)."""
        own = self.own_names(weights)
        for name in [n for n in own if n.endswith("norm.weight")]:
            own[name] = own[name].float() + 1.0
        load_fused_qkv_layers(own, self.config, self.tp)
        self.load_own_state_dict(own)
