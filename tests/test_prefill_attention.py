"""pdserve's C++ causal prefill attention (bf16 dot products: what a bf16 engine's prefill chunks
run where the CPU has AVX512-BF16) against SDPA in float32, and in the engine against the SDPA path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def reference(q, k, v, scale):
    n, m = q.shape[0], k.shape[0]
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)  # query i at position m - n + i
    return F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                          v.float().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("n,m,heads,kv_heads,dim", [(1, 1, 9, 3, 64), (5, 5, 9, 3, 64), (37, 37, 9, 3, 64),
                                                    (40, 100, 9, 3, 64), (70, 70, 4, 4, 128), (33, 65, 16, 2, 128),
                                                    (300, 300, 9, 3, 64)])
def test_prefill_kernel_equals_sdpa(ops, n, m, heads, kv_heads, dim):
    """One token, shorter than a tile, keys before the chunk (a prefix), MHA and GQA groups of 3 and
    8, head sizes 64 and 128: within bf16's rounding of float32 SDPA (probabilities are rounded to
    bf16 for the V products, as a bf16 flash attention does)."""
    if not hasattr(ops, "int4_linear"):
        pytest.skip("this CPU has no AVX512-BF16: the prefill kernel is not built for it")
    torch.manual_seed(n * m + dim)
    q, k, v = (torch.randn(n, heads, dim).bfloat16(), torch.randn(m, kv_heads, dim).bfloat16(),
               torch.randn(m, kv_heads, dim).bfloat16())
    out = torch.full_like(q, float("nan"))
    ops.prefill_attention(q, k, v, out, dim**-0.5)
    torch.testing.assert_close(out.float(), reference(q, k, v, dim**-0.5), atol=2e-2, rtol=2e-2)


def test_prefill_kernel_refuses_bad_input(ops):
    if not hasattr(ops, "int4_linear"):
        pytest.skip("this CPU has no AVX512-BF16")
    q, k = torch.zeros(4, 9, 64).bfloat16(), torch.zeros(4, 3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bf16"):
        ops.prefill_attention(q.float(), k, k, q.float(), 0.125)
    with pytest.raises(RuntimeError, match="head size 64 or 128"):
        ops.prefill_attention(torch.zeros(4, 9, 32).bfloat16(), torch.zeros(4, 3, 32).bfloat16(),
                              torch.zeros(4, 3, 32).bfloat16(), torch.zeros(4, 9, 32).bfloat16(), 0.125)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.prefill_attention(torch.zeros(8, 9, 64).bfloat16(), k, k, torch.zeros(8, 9, 64).bfloat16(), 0.125)


STORY = ("The lighthouse keeper climbed the stairs every evening at dusk, counting the steps as his father "
         "had taught him, and lit the lamp that guided the fishing boats home through the fog. ")


def test_engine_prefill_on_the_kernel_equals_the_sdpa_path(ops):
    """The default model in bf16 on text (random token ids decode near-ties that any rounding
    flips), prompts of a few, ~40 and ~600 tokens in chunks of at most 256 (a later chunk reads the
    earlier chunks' keys from the pool): the same greedy tokens with the kernel as with SDPA."""
    if not hasattr(ops, "prefill_attention"):
        pytest.skip("this CPU has no AVX512-BF16: bf16 prefill runs SDPA")
    from pdserve import LLM, SamplingParams

    llm = LLM(None, dtype="bfloat16", quantization="none", kv_cache_memory_gib=0.1, enable_prefix_caching=False,
              max_num_batched_tokens=256)
    runner = llm.engine.model_runner
    assert runner.prefill_kernel is not None and llm.engine.labels()["prefill_attention"] == "native"
    prompts = ["The capital of France is", STORY + "What did the keeper light?", STORY * 16 + "Who taught him to count?"]
    params = SamplingParams(temperature=0, max_tokens=12)
    with_kernel = [o.token_ids for o in llm.generate(prompts, params)]
    runner.prefill_kernel = None
    assert [o.token_ids for o in llm.generate(prompts, params)] == with_kernel
