"""pdserve's C++ kernels as a CPU of another kind builds them (-march=native picks per machine):
AVX2 only (AMD EPYC before Zen 4) and AVX-512 without bf16 (Skylake to Ice Lake). Each builds; the
kernels that need AVX512-BF16 (int4_linear, the fused decode step, the prefill attention) are left
out, so the engine keeps torch's int4 kernel, the Python layers and SDPA's prefill there; the decode
attention (its AVX-512 or portable loop) equals SDPA; the int8 head equals its float32 GEMM. Run
where this CPU can execute them."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from test_decode_attention import sdpa_reference

from pdserve.models.native import build
from pdserve.models.quantization import native_int4_kernel, quantize_int8_groups
from pdserve.platform import CpuInfo

KINDS = {"x86-64-v3": "avx2", "skylake-avx512": "avx512f"}  # -march, and the flag this CPU needs to run it


@pytest.mark.parametrize("march", list(KINDS))
def test_the_kernels_build_and_compute_for_another_cpu_kind(march, tmp_path):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    if KINDS[march] not in CpuInfo.detect().flags:
        pytest.skip(f"this CPU cannot run a -march={march} build")
    ops = build(march, tmp_path / march)
    assert native_int4_kernel(ops) is None and not hasattr(ops, "DecodeStack")
    assert not hasattr(ops, "prefill_attention")
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, head_dim, block_size in [(9, 3, 64, 16), (4, 1, 256, 16), (16, 2, 128, 32)]:
            kv_cache = torch.randn(2, 200, block_size, kv_heads, head_dim).to(dtype)
            lens = torch.tensor([1, block_size + 1, 37 * block_size - 5])
            tables = torch.stack([torch.randperm(200)[: -(-int(lens.max()) // block_size)] for _ in lens])
            q = torch.randn(len(lens), heads, head_dim).to(dtype)
            expected = sdpa_reference(q, kv_cache, tables, lens, head_dim**-0.5)
            for partition_blocks in (1, 1000):
                out = torch.full_like(q, float("nan"))
                ops.paged_decode_attention(q, kv_cache, tables, lens, out, head_dim**-0.5, partition_blocks)
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    weight, x = torch.randn(96, 128), torch.randn(5, 128)
    head = quantize_int8_groups(weight)
    dequantized = (head.codes.float().reshape(96, 4, 32) * head.scales.unsqueeze(-1)).reshape(96, 128)
    torch.testing.assert_close(ops.int8_head(x, head.codes, head.scales), F.linear(x, dequantized), rtol=1e-5,
                               atol=1e-5)
