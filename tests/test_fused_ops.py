"""pdserve's fused elementwise C++ ops (models/csrc/fused_ops.cpp) against the torch expressions of
the portable path, and their refusals of bad input."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.models.layers import RMSNorm, RotaryEmbedding, apply_rope

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("delta_dtype", DTYPES + [None])
@pytest.mark.parametrize("rows", [1, 37])
def test_add_rms_norm_equals_add_then_rms_norm(ops, out_dtype, delta_dtype, rows):
    torch.manual_seed(rows)
    residual = torch.randn(rows, 576) * 30  # the residual stream runs to tens
    weight = torch.randn(576)
    delta = None if delta_dtype is None else torch.randn(rows, 576).to(delta_dtype)
    expected_residual = residual if delta is None else residual + delta.float()
    expected = F.rms_norm(expected_residual, (576,), weight, 1e-5)
    got_residual, out = residual.clone(), torch.empty(rows, 576, dtype=out_dtype)
    ops.add_rms_norm(got_residual, delta, weight, out, 1e-5)
    assert torch.equal(got_residual, expected_residual)  # the add is exact, and in place
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        # Rounded to bf16: a float32 value that torch's reduction order puts on the other side of a
        # rounding boundary may land one bf16 step away (an AMX Xeon: 1 of 21312), never further.
        step = 2.0 ** (torch.frexp(expected)[1].float() - 8)
        assert ((out.float() - expected.to(out_dtype).float()).abs() <= step).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_rotates_strided_heads_in_place(ops, dtype):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0, 4096)
    qkv = torch.randn(5, 15, 64).to(dtype)  # 9 q + 3 k heads rotated, 3 v heads not
    qk = qkv[:, :12]
    positions = torch.tensor([0, 1, 17, 2048, 4095])
    # The portable path's expression, in the model's dtype (so with its roundings, as transformers has them).
    expected = apply_rope(qk, rope.cos[positions].unsqueeze(1).to(dtype), rope.sin[positions].unsqueeze(1).to(dtype))
    v_before = qkv[:, 12:].clone()
    ops.rotary_embedding(qk, positions, rope.cos, rope.sin)
    if dtype == torch.bfloat16:
        assert torch.equal(qk, expected)  # the same roundings, op by op
    else:
        torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 12:], v_before)


def test_rotary_tables_are_the_correctly_rounded_cos_and_sin_of_the_angles_in_every_process():
    """Every element, as libm's double cos / sin rounded once to float32, of transformers' float32
    angles; and the same bits in fresh processes, where float32 tables once differed by process."""
    rope = RotaryEmbedding(64, 100000.0, 4656)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    rows = torch.tensor([0, 1, 2, 3, 777, 2327, 2328, 3000, 4655])
    angles = torch.outer(rows.float(), inv_freq)  # float32, as transformers computes them
    want_cos = torch.tensor([[math.cos(a) for a in row] for row in angles.tolist()]).float()
    want_sin = torch.tensor([[math.sin(a) for a in row] for row in angles.tolist()]).float()
    assert torch.equal(rope.cos[rows, :32], want_cos) and torch.equal(rope.cos[rows, 32:], want_cos)
    assert torch.equal(rope.sin[rows, :32], want_sin) and torch.equal(rope.sin[rows, 32:], want_sin)
    digest = "import hashlib; from pdserve.models.layers import RotaryEmbedding as R; r = R(64, 100000.0, 4656); " \
             "print(hashlib.sha1(r.cos.numpy().tobytes() + r.sin.numpy().tobytes()).hexdigest())"
    here = hashlib.sha1(rope.cos.numpy().tobytes() + rope.sin.numpy().tobytes()).hexdigest()
    for _ in range(3):
        assert subprocess.run([sys.executable, "-c", digest], capture_output=True, text=True,
                              check=True).stdout.strip() == here


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(ops, dtype):
    torch.manual_seed(1)
    gate_up = (torch.randn(7, 2 * 1536) * 8).to(dtype)  # wide enough for both tails of the sigmoid
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up  # in the model's dtype, as the portable path computes it
    got = ops.silu_and_mul(gate_up)
    if dtype == torch.bfloat16:  # our exp and torch's may round a few silu values to neighbouring bf16s
        assert (got != expected).float().mean() < 0.01
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_model_modules_take_the_native_path_only_when_told(ops):
    """The modules' two paths agree; the native one updates the residual stream in place too."""
    torch.manual_seed(2)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    residual, delta = torch.randn(3, 64), torch.randn(3, 64)
    portable_residual = residual.clone()
    expected = norm(delta, portable_residual)
    norm.native = ops
    native_residual = residual.clone()
    got = norm(delta, native_residual)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(native_residual, portable_residual)
    torch.testing.assert_close(native_residual, residual + delta)


def test_ops_refuse_bad_input_with_a_message(ops):
    cos = sin = torch.zeros(16, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotary_embedding(torch.zeros(1, 2, 8), torch.tensor([16]), cos, sin)
    with pytest.raises(RuntimeError, match="positions must be contiguous int64"):
        ops.rotary_embedding(torch.zeros(1, 2, 8), torch.tensor([1], dtype=torch.int32), cos, sin)
    with pytest.raises(RuntimeError, match="residual must be contiguous float32"):
        ops.add_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), None, torch.ones(8), torch.zeros(2, 8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be contiguous float32 of the rows' size"):
        ops.add_rms_norm(torch.zeros(2, 8), None, torch.ones(4), torch.zeros(2, 8), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up must be contiguous"):
        ops.silu_and_mul(torch.zeros(2, 7))
