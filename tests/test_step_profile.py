"""The decode step breakdown (`python -m pdserve.benchmarks.engine --breakdown`) on the embedded model."""

from __future__ import annotations

import pytest

from pdserve.benchmarks.step_profile import KINDS, op_kind, profile_decode


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


def test_a_breakdown_accounts_for_the_step_and_every_layer():
    """Batch 1 and 2 at a short context on the default path: the GEMMs and the attention are
    seen (the C++ kernels through their annotations), the ops' own times account for most of the
    profiled steps' wall time and never more, and each of the 30 layers has its own time."""
    result = profile_decode(None, "auto", "auto", (1, 2), (40,))
    for point in result["points"]:
        ms = point["ms"]
        assert set(ms) == {*KINDS, "overhead"} and ms["gemm"] > 0 and ms["attention"] > 0
        assert 0.3 * point["profiled_step_ms"] <= sum(ms[k] for k in KINDS) <= point["profiled_step_ms"]
        assert len(point["layer_ms"]) == 30 and min(point["layer_ms"]) > 0
        assert point["layers_sum_ms"] < point["step_ms"] * 1.5
