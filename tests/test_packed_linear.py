"""The oneDNN-packed projection (bf16 on CPU): row padding is bounded and does not change results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.models.layers import Linear, padded_rows
from pdserve.models.native import native_ops
from pdserve.platform import CpuInfo, onednn_bf16_prepack_works, onednn_float32_works


def test_padded_rows_is_small_bounded_and_monotone():
    sizes = [padded_rows(rows) for rows in range(1, 8193)]
    assert sizes[:16] == list(range(1, 17))  # decode batches up to 16 are not padded
    for rows, size in enumerate(sizes, start=1):
        assert rows <= size <= rows + rows // 8, rows
    assert sizes == sorted(sizes)
    # A few shapes per doubling: 16 exact sizes, then 8 per power of two up to 8192.
    assert len(set(sizes)) == 16 + 8 * 9


@pytest.mark.skipif(not (CpuInfo.detect().onednn_bf16 and onednn_bf16_prepack_works()),
                    reason="oneDNN takes no bf16 on this CPU (no packing)")
@pytest.mark.parametrize("rows", [1, 7, 17, 33, 100, 257])
def test_packed_linear_equals_plain_linear(rows):
    torch.manual_seed(rows)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    layer.pack_for_cpu()
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float(), bias.float()), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not onednn_float32_works(), reason="oneDNN takes no float32 GEMM with a plain weight here")
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 100])
def test_float32_linear_on_onednn_equals_f_linear(rows):
    """A float32 projection on oneDNN (the native kernels' path from 4 rows; the output head at any
    count): the same values as F.linear, padded rows or not, and F.linear itself below 4 rows."""
    torch.manual_seed(rows)
    layer = Linear(64, 96, bias=True)
    layer.onednn_float32 = True
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        out = layer(x)
        expected = F.linear(x, layer.weight, layer.bias)
    assert out.shape == (rows, 96)
    if rows < layer.onednn_min_rows:
        assert torch.equal(out, expected)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_native_kernels_put_float32_gemms_on_onednn_where_it_runs():
    from pdserve import LLM

    llm = LLM(None, dtype="float32", quantization="none", kv_cache_memory_gib=0.05)
    if llm.engine.plan.compiled and native_ops() is not None:  # else F.linear everywhere: nothing set
        linears = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.onednn_float32 == onednn_float32_works() for m in linears)
    else:
        assert not any(m.onednn_float32 for m in llm.engine.model_runner.model.modules() if isinstance(m, Linear))
