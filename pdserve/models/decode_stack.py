"""The fused decode step: a step whose rows are all decodes runs the layers in one C++ call.

At SmolLM2's size a decode step's kernels take ~5 ms at batch 1 and the ~35 torch calls a layer
makes from Python took ~2.5 ms more. `DecodeStack` (csrc/decode_stack.cpp) calls the same kernels
in the same order on the same tensors, so its results are the Python layers' bit for bit
(tests/test_decode_stack.py); the Python layers stay the definition, and the path for every other
step (prefill chunks, mixed batches, more rows than the int4 kernel takes, a layer hook).

It runs where its kernels do (pdserve's C++ kernels, int4 projections on `int4_linear`: AVX512-BF16
CPUs) and for the layers it knows: the shared DecoderLayer with QKVAttention (no q/k norm) and the
SiLU MLP, one RoPE for every layer, one rank (no TP all-reduce), not batch-invariant mode.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from pdserve.models.attention import AttentionMetadata
from pdserve.models.layers import MLP, DecoderLayer, Linear, QKVAttention
from pdserve.models.quantization import NativeInt4Weight


def build_decode_stack(model: Any, ops: ModuleType, one_rope: bool) -> Any | None:
    """A C++ DecodeStack over `model`'s layers (a DecoderLM whose layers all take `model.rope`'s
    rotation where `one_rope`), or None where it cannot run them."""
    stack_cls = getattr(ops, "DecodeStack", None)
    if (stack_cls is None or not one_rope or model.tp.size > 1
            or model.compute_dtype not in (torch.float32, torch.bfloat16) or model.decode_attention != "paged"):
        return None
    layers = list(model.layers)
    if not layers or not all(_fits(layer) for layer in layers):
        return None
    attn = layers[0].self_attn
    stack = stack_cls(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                      layers[0].input_layernorm.eps, model.compute_dtype)
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        *_projection(a.qkv_proj), *_projection(a.o_proj), *_projection(mlp.gate_up_proj),
                        *_projection(mlp.down_proj), a.window)
    return stack


def _fits(layer: Any) -> bool:
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not QKVAttention or type(layer.mlp) is not MLP:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (attn.q_norm is None and mlp.activation == "silu" and mlp.native is not None
            and all(n.native is not None and n.weight.dtype == torch.float32 and n.eps == norms[0].eps
                    for n in norms)
            and all(isinstance(p.quantized, NativeInt4Weight) and not p.batch_invariant
                    for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))


def _projection(linear: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    bias = linear.bias.detach() if linear.bias is not None else None
    return linear.quantized.codes, linear.quantized.scales_and_zeros, bias


def runs_fused(meta: AttentionMetadata | list[AttentionMetadata], max_rows: int) -> bool:
    """Whether a step with this metadata is one the DecodeStack runs: one KV group, every row a
    decode (at most `max_rows`: as many as the int4 kernel takes) in one group of the C++ decode
    attention."""
    return (isinstance(meta, AttentionMetadata) and meta.decode_kernel is not None and meta.rows_alone is None
            and not meta.prefills and len(meta.decode_groups) == 1
            and 0 < meta.num_decodes == len(meta.slot_mapping) and meta.num_decodes <= max_rows)
