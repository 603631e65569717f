"""Weight-only quantization of the projections, for decode: fewer weight bytes read per token.

A decode step streams every weight once, so at small batch its time is weight bytes / memory
bandwidth. int4 (groups of 32 along the input, a bf16 scale and offset each: GGUF's Q4_1 layout)
reads 0.625 bytes a weight, ~1/6 of float32's; int8 (one scale per output channel) ~1/4. int4 runs on
pdserve's C++ `int4_linear` where the CPU has bf16 dot products (AVX512-BF16: csrc/int4_linear.cpp,
its own code layout; at the read bandwidth at batch 1; from 2 rows on AMX tiles where the CPU has
them, 4.0x its AVX-512 path at 8 rows and 5.0x at 16 in docs/benchmarks.md's kernels run), elsewhere on
torch's CPU kernel (`_weight_int4pack_mm_for_cpu`); int8 on torch's `_weight_int8pack_mm`. Each
takes bfloat16 activations (torch's float32 path is a scalar one ~10x slower), so a small batch is
cast to bf16 (and torch's kernels' output back).

Only decode rows take the quantized kernels, and only while a step has at most MAX_QUANTIZED_ROWS of
them (AMX_MAX_QUANTIZED_ROWS where pdserve's kernels run on AMX tiles): beyond, and for prefill, a
dense GEMM is compute-bound and faster. So each layer also keeps its
dense weight, the file's own (the GGUF's dequantization, fp16 scales included: exact in float32,
rounded once in bf16): prefill, scoring and prompt logprobs compute the file's model, and only the
decode kernels approximate it. Choosing by row kind, not by batch size, keeps a token's path
independent of what it is batched with (up to 16 decodes; on AMX, of 2 to 32): a decode node
computes it as a colocated node does.

What the decode kernels approximate:
- int4, a weight that came from GGUF's Q4_1: its groups hold their own minimum and maximum (q = 0
  and q = 15), so min/max requantization gives back the file's codes; only the group scale and
  offset are rounded to bf16 (the kernel's format), at most 2^-9 of their value, and the activations
  are rounded to bf16. Q4_0 and Q4_K groups do not span their full code range, so `auto`
  requantizes them (within half a step).
- The output head (int8 in groups of 32, pdserve's C++ kernel, float32 activations and logits): a
  Q8_0 head is the file's exactly (each group's largest code is +-127, so amax / 127 gives back its
  fp16 scale); another is requantized within half a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from pdserve.config import QUANTIZATIONS

INT4_GROUP = 32
# Decodes per step up to which a layer runs its quantized kernel; above, the dense GEMM is faster
# (SmolLM2 decode, batch 16 / 24: int4 223 / 235 tok/s, float32 205 / 275, on AVX-512 and AVX2 alike).
MAX_QUANTIZED_ROWS = 16
# On AMX tiles (pdserve's int4_linear and int8 head) up to 32: SmolLM2's 30 gate/up at 24 / 32 / 48
# rows 7.9 / 10.7 / 13.9 ms against oneDNN's bf16 13.4 / 13.8 / 12.8; the head 7.3 / 7.7 / 11.3 ms
# against float32 21.5 / 25.0 / 30.3 (a Xeon with AMX, one thread).
AMX_MAX_QUANTIZED_ROWS = 32
# GGUF weight types `auto` serves as int4 / int8 (a float GGUF or HF checkpoint runs unquantized).
_GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K"}
_GGUF_INT8 = {"Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}


def resolve_quantization(requested: str, gguf_weight_type: str | None, device: str) -> str:
    """none | int8 | int4 for `requested`; `auto` follows the GGUF's main weight type."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {requested!r}")
    if requested == "auto":
        if torch.device(device).type != "cpu":
            return "none"
        if gguf_weight_type in _GGUF_INT4:
            return "int4"
        return "int8" if gguf_weight_type in _GGUF_INT8 else "none"
    if requested != "none" and torch.device(device).type != "cpu":
        raise ValueError(f"quantization {requested} runs on CPU only (device {device}); use --quantization none")
    return requested


@dataclass
class Int4Weight:
    """[N, K] weight as 4-bit codes q in groups of INT4_GROUP along K: w = (q - 8) * scale + zero."""

    packed: torch.Tensor  # torch's CPU int4 layout, uint8 [N, K / 2]
    scales_and_zeros: torch.Tensor  # bf16 [K / group, N, 2]

    def __call__(self, x: torch.Tensor, rows_alone: bool = False) -> torch.Tensor:  # rows alone at any count
        out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, INT4_GROUP, self.scales_and_zeros)
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


@dataclass
class NativeInt4Weight:
    """The same codes, scales and zeros as Int4Weight, laid out for pdserve's `int4_linear`
    (csrc/int4_linear.cpp): panels of 64 output rows, each a contiguous stream."""

    codes: torch.Tensor  # int16 [N / 64, K / 32 * 512]: 4 codes per 16-bit lane
    scales_and_zeros: torch.Tensor  # bf16 [N / 64, K / 32 * 128]
    kernel: Callable[..., torch.Tensor]

    def __call__(self, x: torch.Tensor, rows_alone: bool = False) -> torch.Tensor:  # float32 or bf16 in and out
        """rows_alone: one kernel path at any row count (on AMX, one row takes AVX-512's otherwise)."""
        return self.kernel(x.contiguous(), self.codes, self.scales_and_zeros, rows_alone)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales_and_zeros.nbytes


@dataclass
class Int8Weight:
    """[N, K] weight as int8 codes with one scale per output row: w = q * scale."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # bf16 [N]

    def __call__(self, x: torch.Tensor, rows_alone: bool = False) -> torch.Tensor:  # rows alone at any count
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


@dataclass
class Int8GroupWeight:
    """[N, K] weight as int8 codes with a float32 scale per group of INT8_GROUP along K (GGUF's Q8_0
    layout): w = q * scale. Run by pdserve's C++ `int8_head` (float32 in, float32 out)."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / group]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


QuantizedWeight = Int4Weight | NativeInt4Weight | Int8Weight
INT8_GROUP = 32


NATIVE_INT4_PANEL = 64  # int4_linear: output rows per panel


def max_quantized_rows(weight: QuantizedWeight | Int8GroupWeight | None, ops: ModuleType | None) -> int:
    """Decode rows a step may run on `weight`'s kernel: more where pdserve's kernel runs on AMX tiles."""
    on_tiles = isinstance(weight, (NativeInt4Weight, Int8GroupWeight)) and ops is not None and ops.amx()
    return AMX_MAX_QUANTIZED_ROWS if on_tiles else MAX_QUANTIZED_ROWS


def native_int4_kernel(ops: ModuleType | None) -> Callable | None:
    """pdserve's `int4_linear`, where built (compiled only for CPUs with AVX512-BF16)."""
    return getattr(ops, "int4_linear", None) if ops is not None else None


def can_quantize(method: str, weight: torch.Tensor) -> bool:
    """Whether torch's kernel takes this shape (int4: N % 16 and K % 32; int8: K % 8)."""
    n, k = weight.shape
    if method == "int4":
        return n % 16 == 0 and k % INT4_GROUP == 0
    return k % 8 == 0


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max 4-bit codes of a [N, K] weight in groups along K: codes [N, K/g, g], step and low [N, K/g, 1]
    with weight ~ codes * step + low (exactly, for a weight dequantized from GGUF's Q4_0 / Q4_1)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    return ((groups - low) / step).round_().clamp_(0, 15), step, low


def quantize_int4(weight: torch.Tensor, kernel: Callable | None = None
                  ) -> tuple[Int4Weight | NativeInt4Weight, torch.Tensor]:
    """The int4 form of a float [N, K] weight and the float32 weight it stands for; laid out for
    `kernel` (pdserve's int4_linear) when given and N is a multiple of its panel, else for torch's."""
    n, k = weight.shape
    codes, step, low = int4_codes(weight)
    # The kernels' codes are centred: (q - 8) * scale + zero, so zero = low + 8 * scale.
    scale = step.squeeze(-1).bfloat16()
    zero = (low + 8 * step).squeeze(-1).bfloat16()
    dequantized = ((codes - 8) * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).reshape(n, k)
    if kernel is not None and n % NATIVE_INT4_PANEL == 0:
        return NativeInt4Weight(*native_int4_layout(codes, scale, zero), kernel), dequantized
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.reshape(n, k).to(torch.int32), 1)
    scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()  # [K / group, N, 2]
    return Int4Weight(packed, scales_and_zeros), dequantized


def native_int4_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """int4_linear's layout (csrc/int4_linear.cpp) of codes [N, K / 32, 32] and bf16 scale, zero [N, K / 32].
    Per panel of 64 rows and group: 4 vectors (l) x 4 blocks of 16 rows (c) x 32 lanes (2 j + p), lane
    nibble t holding row j's code at k = 2 (4 l + t) + p of the group; then per group and block 16
    scales and 16 zeros."""
    n, groups, _ = codes.shape
    panels = n // NATIVE_INT4_PANEL
    q = codes.to(torch.int32).reshape(panels, 4, 16, groups, 4, 4, 2)  # [panel, c, j, g, l, t, p]
    q = q.permute(0, 3, 4, 1, 2, 6, 5)  # [panel, g, l, c, j, p, t]
    lanes = (q << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1, dtype=torch.int32)
    lanes = torch.where(lanes >= 1 << 15, lanes - (1 << 16), lanes)  # the 16 bits, as int16
    lanes = lanes.to(torch.int16).reshape(panels, groups * 512).contiguous()
    scales = torch.stack((scale.reshape(panels, 4, 16, groups), zero.reshape(panels, 4, 16, groups)), 2)
    scales = scales.permute(0, 4, 1, 2, 3).reshape(panels, groups * 128).contiguous()  # [panel, g, c, 2, j]
    return lanes, scales


def quantize_int8(weight: torch.Tensor) -> tuple[Int8Weight, torch.Tensor]:
    """The int8 form of a float [N, K] weight (symmetric, per row) and the float32 weight it stands for."""
    w = weight.float()
    scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny).bfloat16()
    codes = (w / scale.float().unsqueeze(-1)).round_().clamp_(-128, 127)
    return Int8Weight(codes.to(torch.int8), scale), codes * scale.float().unsqueeze(-1)


def quantize_int8_groups(weight: torch.Tensor) -> Int8GroupWeight:
    """Symmetric int8 codes per group of 32 along K; a Q8_0 weight's own codes and scales exactly."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // INT8_GROUP, INT8_GROUP)
    scale = (groups.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (groups / scale.unsqueeze(-1)).round_().clamp_(-127, 127)
    return Int8GroupWeight(codes.to(torch.int8).reshape(n, k), scale.contiguous())


def quantize(method: str, weight: torch.Tensor, int4_kernel: Callable | None = None
             ) -> tuple[QuantizedWeight, torch.Tensor]:
    return quantize_int4(weight, int4_kernel) if method == "int4" else quantize_int8(weight)
