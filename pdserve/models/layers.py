"""The layers decoder families share: projections that decode on quantized or pre-packed weights,
float32 RMSNorm, rotary embeddings (YaRN too), the fused-QKV attention (sliding windows too), the
gated MLP (SiLU, GeGLU), the pre-norm decoder block, and
the helpers that slice HF weights for a tensor-parallel rank.

For the decode cost of a small model on a CPU (mostly kernel launches), Q, K, V are one fused
projection and so are gate and up, and the elementwise chains (residual add + norm, rotary
embedding, SiLU * up) run as one C++ op each where pdserve's kernels are built
(`use_native_kernels`); the torch expressions beside them are the portable path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionMetadata, paged_attention
from pdserve.models.batch_invariant import in_fixed_blocks
from pdserve.models.parallel import TensorParallel
from pdserve.models.quantization import (
    MAX_QUANTIZED_ROWS,
    Int8GroupWeight,
    QuantizedWeight,
    quantize,
    quantize_int8_groups,
)


def padded_rows(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per power of two (at most 1/8 padding; exact up to 16).

    oneDNN keeps a compiled kernel (and more state) for every distinct input shape it sees: fed
    every batch size a prefill node meets, its RSS grew by ~30 % over a 10,000-request soak.
    Rounding bounds the number of shapes (8 per doubling), like vLLM's CUDA-graph batch sizes.
    """
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class Linear(nn.Linear):
    """nn.Linear that can run small batches on quantized weights (models/quantization.py), and big
    ones on oneDNN's pre-packed weights (bf16 on a CPU, where pdserve.platform chooses the onednn
    path: ~1.5x faster GEMV with bf16 arithmetic)."""

    packed_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None
    max_quantized_rows = MAX_QUANTIZED_ROWS  # decode rows a step runs on `quantized` (set with the native kernels)
    batch_invariant = False  # models/batch_invariant.py
    # float32 GEMMs of at least `onednn_min_rows` rows on oneDNN (set with the native kernels): torch's
    # F.linear (MKL) ran them 1.4-2.4x slower on an AMD EPYC from 4 rows up; at 1-2 rows it was
    # faster on the smaller projections (oneDNN's per-call cost).
    onednn_float32 = False
    onednn_min_rows = 4

    def quantize(self, method: str, int4_kernel: Callable | None = None) -> None:
        """Decode on `method` codes (int4 laid out for `int4_kernel`, pdserve's, where given); the
        dense weight stays the file's (prefill computes the file's model, only the decode kernel
        approximates it)."""
        self.quantized, _ = quantize(method, self.weight.detach(), int4_kernel)

    def pack_for_cpu(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self.weight = None  # the packed copy replaces it (a tied embedding keeps its own reference)

    def forward(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:  # x: [rows, in_features]
        """`decode_rows`: x's first rows are decodes. They run on the quantized kernel (when there are
        few: memory-bound), prefill rows on the dense weights. So the path a token takes does not
        depend on what else is in the batch: a decode node and a colocated one compute it alike.
        Batch-invariant: decode rows take the kernel at any count, and GEMMs run in fixed blocks."""
        dense = self._dense_in_blocks if self.batch_invariant else self._dense
        few = decode_rows <= self.max_quantized_rows or self.batch_invariant
        if self.quantized is None or decode_rows == 0 or not few:
            return dense(x)
        # The quantized kernels compute each row alone (tests/test_batch_invariant.py checks it on
        # every machine; int4 on AMX told to keep one path at any count), so batch-invariant decode
        # rows need no fixed blocks: padding them cost 3x.
        decoded = self._quantized(x[:decode_rows])
        if self.bias is not None:
            decoded = decoded + self.bias
        return decoded if decode_rows == x.shape[0] else torch.cat((decoded, dense(x[decode_rows:])))

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x, rows_alone=self.batch_invariant)

    def _dense_in_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return in_fixed_blocks(self._dense, x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        weight = self.packed_weight
        if weight is None:
            if not (self.onednn_float32 and rows >= self.onednn_min_rows and x.dtype == torch.float32):
                return F.linear(x, self.weight, self.bias)
            weight = self.weight  # oneDNN takes a plain float32 weight as it lies
        if padded_rows(rows) != rows:
            x = F.pad(x, (0, 0, 0, padded_rows(rows) - rows))
        return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")[:rows]


class OutputHead(Linear):
    """The output head: float32 logits on every path, nothing rounded between it and the sampler
    (bf16 logits, a step of 0.125 at SmolLM2's magnitudes, made greedy ties and wrong answers).

    Its weight stays float32 whatever the model's dtype: the file's values (a tied embedding reads
    them too). Decode rows, while at most `max_quantized_rows`, run on int8 codes in groups of 32
    (GGUF's Q8_0 layout; 1/4 of the bytes a decode step streams) through pdserve's C++ `int8_head`,
    which takes and writes float32; prefill rows, bigger batches and the portable path (no C++
    kernels) take a float32 GEMM: oneDNN's at any row count where the native kernels run (a 1-row
    GEMV over this 49152 x 576 weight 3.7 ms against F.linear's 7.4 on an AMD EPYC)."""

    native: ModuleType | None = None  # pdserve's C++ kernels, where built
    quantized: Int8GroupWeight | None = None
    onednn_min_rows = 1

    def quantize(self, method: str, int4_kernel: Callable | None = None) -> None:
        self.quantized = quantize_int8_groups(self.weight.detach())

    def forward(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        return super().forward(x.float(), decode_rows if self.native is not None else 0)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.int8_head(x.contiguous(), self.quantized.codes, self.quantized.scales,
                                     rows_alone=self.batch_invariant)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; its output is cast to the dtype of the projections it feeds."""

    native: ModuleType | None = None  # pdserve's C++ kernels (models/native.py), where built

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.out_dtype: torch.dtype | None = None  # None: the input's dtype

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x; with `residual` (the float32 residual stream), x is first added into it, in
        place, and the sum is normalized."""
        if residual is not None:
            if self.native is not None:
                out = torch.empty(residual.shape, dtype=self.out_dtype or residual.dtype, device=residual.device)
                self.native.add_rms_norm(residual, x, self.weight, out, self.eps)
                return out
            x = residual.add_(x)
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(self.out_dtype or x.dtype)


# Rotates [T, heads, head_dim] query / key heads (in place where it can) and returns them.
Rotation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension (rope_type "yarn"): low frequencies interpolated by `factor`, high ones
    kept, a linear ramp between; cos / sin scaled by the attention factor."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Yarn | None:
        rope = cfg.hf.get("rope_parameters") or cfg.hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) != "yarn":
            return None
        original = rope["original_max_position_embeddings"]
        return cls(rope.get("factor") or cfg.max_position_embeddings / original, original,
                   rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0, rope.get("mscale"),
                   rope.get("mscale_all_dim"), rope.get("attention_factor"), rope.get("truncate", True))

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_scale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.get_mscale(self.factor, self.mscale) / self.get_mscale(self.factor, self.mscale_all_dim)
        return self.get_mscale(self.factor)

    def extend(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """Plain RoPE's inverse frequencies (of a head of 2 x len(inv_freq) dims), extended."""
        dim = 2 * len(inv_freq)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
                / (high - low or 0.001)).clamp(0, 1)  # 0: kept as trained, 1: interpolated
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    native: ModuleType | None = None  # pdserve's C++ kernels (models/native.py), where built

    def __init__(self, head_dim: int, theta: float, max_positions: int, yarn: Yarn | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions, self.yarn = head_dim, theta, max_positions, yarn
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """Fill the cos/sin tables (float32; also after the model was built on the meta device).

        The angles are transformers' float32 ones; cos and sin are taken in float64 and rounded once
        to float32. Taken in float32, about one process in eight (an AMX Xeon) got other cos values
        in the half of the table its main thread computed (sin not; the same call later in that
        process gave the usual ones): every token's RoPE moved in bf16, so that node's answers
        differed from the other nodes' under --batch-invariant. Correctly rounded values do not
        depend on the code path a thread takes."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        if self.yarn is not None:
            inv_freq = self.yarn.extend(inv_freq, self.theta)
        freqs = torch.outer(torch.arange(self.max_positions, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).double()
        scale = self.yarn.cos_sin_scale if self.yarn is not None else 1.0
        self.cos, self.sin = (emb.cos() * scale).float(), (emb.sin() * scale).float()

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of a forward pass's tokens at `positions`, for every layer."""
        if self.native is not None and dtype in (torch.float32, torch.bfloat16):
            def rotate(x: torch.Tensor) -> torch.Tensor:
                self.native.rotary_embedding(x, positions, self.cos, self.sin)
                return x
            return rotate
        # Portable: the [T, 1, D] tables, looked up once per forward pass.
        cos, sin = self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
        return lambda x: apply_rope(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class QKVAttention(nn.Module):
    """Attention through one fused Q/K/V projection over the K/V paged attention (models/attention.py):
    Llama's and its relatives', Gemma's. `qk_norm`: an RMSNorm per head on q and k before RoPE;
    `scale`: the softmax scale (1 / sqrt(head_dim) unless given); `window` > 0: a sliding-window
    layer, each query attending to its last `window` positions."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False, scale: float | None = None, window: int = 0) -> None:
        super().__init__()
        self.tp, self.window = tp, window  # this rank's heads only; o_proj's partial sums are all-reduced
        self.num_heads, self.num_kv_heads = len(tp.heads(cfg.num_heads)), len(tp.kv_heads(cfg.num_kv_heads))
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.scale = scale if scale is not None else cfg.head_dim**-0.5

    def forward(self, x, rotate: Rotation, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x, meta.num_decodes)
        num_tokens, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = rotate(qk)  # q and k heads rotated in one pass
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.tp.all_reduce(self.o_proj(out.flatten(1), meta.num_decodes))


class MLP(nn.Module):
    """Gated MLP: SiLU (a MoE's experts are these too) or, `activation="gelu_tanh"`, GeGLU (Gemma's)."""

    native: ModuleType | None = None  # pdserve's C++ kernels (models/native.py), where built

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TensorParallel,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"MLP activation must be silu or gelu_tanh, got {activation!r}")
        self.activation = activation
        self.tp = tp  # this rank's slice of the intermediate size; down_proj's partial sums are all-reduced
        rows = len(tp.rows(intermediate_size))
        self.gate_up_proj = Linear(hidden_size, 2 * rows, bias=bias)
        self.down_proj = Linear(rows, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, decode_rows: int = 0, reduce: bool = True) -> torch.Tensor:
        """`reduce`: all-reduce the ranks' partial sums now (a MoE sums its experts' first, once)."""
        gate_up = self.gate_up_proj(x, decode_rows)
        if self.activation == "gelu_tanh":  # no C++ kernel: torch's GELU (tanh approximation)
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(F.gelu(gate, approximate="tanh") * up, decode_rows)
        elif self.native is not None:
            out = self.down_proj(self.native.silu_and_mul(gate_up), decode_rows)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up, decode_rows)
        return self.tp.all_reduce(out) if reduce else out


class DecoderLayer(nn.Module):
    """Pre-norm residual block around a family's attention and MLP."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None, rotate: Rotation, kv_cache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Adds the previous layer's output `delta` into the residual stream (in place, fused with
        the norm) and returns this layer's output, which the next layer adds."""
        h = self.input_layernorm(residual) if delta is None else self.input_layernorm(delta, residual)
        h = self.self_attn(h, rotate, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm(h, residual), meta.num_decodes)


def rows_of(part: range, size: int) -> slice:
    """The rows of `part` (heads of `size` rows each) in a weight split along its first dimension."""
    return slice(part.start * size, part.stop * size)


def load_fused_qkv_layers(own: dict[str, torch.Tensor], cfg: ModelConfig, tp: TensorParallel) -> None:
    """The layers of a fused-QKV family (Llama's, Gemma's) from HF names: q/k/v into `qkv_proj` and
    gate/up into `gate_up_proj` (this rank's heads and rows), o_proj and down_proj row-parallel."""
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


def load_mlp(own: dict[str, torch.Tensor], prefix: str, rows: slice, tp: TensorParallel) -> None:
    """An HF MLP's gate and up fused into `gate_up_proj` (this rank's `rows`), its down_proj row-parallel."""
    for suffix in ("weight", "bias"):
        gate, up = own.pop(f"{prefix}gate_proj.{suffix}", None), own.pop(f"{prefix}up_proj.{suffix}", None)
        if gate is not None:
            own[f"{prefix}gate_up_proj.{suffix}"] = torch.cat((gate[rows], up[rows]))
    row_parallel(own, f"{prefix}down_proj", rows, tp)


def row_parallel(own: dict[str, torch.Tensor], name: str, cols: slice, tp: TensorParallel) -> None:
    """TP: this rank's input columns of a row-parallel projection; its bias added once (rank 0)."""
    if tp.size > 1:
        own[f"{name}.weight"] = own[f"{name}.weight"][:, cols].contiguous()
        if f"{name}.bias" in own and tp.rank:
            own[f"{name}.bias"] = torch.zeros_like(own[f"{name}.bias"])
