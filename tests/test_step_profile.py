"""The decode step breakdown (`python -m pdserve.benchmarks.engine --breakdown`) on the embedded model."""

from __future__ import annotations

import pytest

from pdserve.benchmarks.step_profile import KINDS, op_kind, profile_decode, roofline_lines


@pytest.mark.parametrize("name, kind", [
    ("aten::linear", "gemm"), ("aten::_weight_int4pack_mm_for_cpu", "gemm"), ("native::int8_head", "gemm"),
    ("native::int4_linear", "gemm"),
    ("mkldnn::_linear_pointwise", "gemm"), ("native::paged_decode_attention", "attention"),
    ("aten::scaled_dot_product_attention", "attention"), ("aten::index_copy_", "kv_write"),
    ("native::add_rms_norm", "norm_rope_act"), ("native::rotary_embedding", "norm_rope_act"),
    ("aten::argmax", "sampling"), ("aten::cat", "other_ops"),
])
def test_ops_fall_in_their_kind(name, kind):
    assert op_kind(name) == kind


@pytest.mark.parametrize("block_size", [16, 32])
def test_a_breakdown_accounts_for_the_step_and_every_layer(block_size):
    """Batch 1 and 2 at a short context on the default path, on blocks of 16 and of 32 tokens: the
    GEMMs and the attention are seen (the C++ kernels through their annotations), the ops' own
    times account for most of the profiled steps' wall time and never more, and each of the 30
    layers has its own time."""
    result = profile_decode(None, "auto", "auto", (1, 2), (40,), block_size)
    assert result["block_size"] == block_size
    assert result["streamed_params"] > 130e6 and 0 < result["weight_bytes"] < 4 * result["streamed_params"]
    for point in result["points"]:
        ms = point["ms"]
        assert set(ms) == {*KINDS, "overhead"} and ms["gemm"] > 0 and ms["attention"] > 0
        assert 0.3 * point["profiled_step_ms"] <= sum(ms[k] for k in KINDS) <= point["profiled_step_ms"]
        assert len(point["layer_ms"]) == 30 and min(point["layer_ms"]) > 0
        # The layers' times come from the Python layers (hooks), which run unfused: slower than the
        # fused step (1.2-1.4x on a quiet AVX-512 machine, more beside other work), never by far.
        assert point["layers_sum_ms"] < point["step_ms"] * 2.5


def test_rooflines_hold_a_step_against_the_machine():
    config = {"engine": {"dtype": "bfloat16"}, "streamed_params": 10**8, "weight_bytes": 100 * 2**20,
              "kv_bytes_per_token": 1024, "points": [{"batch": 1, "context": 128, "step_ms": 10.0},
                                                     {"batch": 8, "context": 128, "step_ms": 24.0}]}
    first, second = roofline_lines({"x": config}, {"read_bandwidth_gbs": 10.0, "gemm_gflops": {"bfloat16": 200.0}})
    # 100 MiB of weights + 128 tokens x 1 KiB of KV = 104988672 bytes: 10.50 ms at 10 GB/s.
    assert "reads 100 MiB a step, 10.50 ms at the read bandwidth" in first and "1.05x the memory roofline" in first
    # (24 - 10) / 7 = 2 ms an extra sequence; 0.2 GFLOP at 200 GFLOP/s = 1 ms.
    assert "1 -> 8: 2.00 ms" in second and "0.20 GFLOP take 1.00 ms" in second
