"""The fused decode step (models/decode_stack.py): where it runs, a decode step's numbers are the
Python layers' bit for bit; where it cannot, the Python layers run."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.quantization import MAX_INT4_ROWS_AMX, MAX_QUANTIZED_ROWS, max_int4_rows, native_int4_kernel
from pdserve.platform import CpuInfo


@pytest.fixture(scope="module")
def int4_ops(ops):
    if native_int4_kernel(ops) is None:
        pytest.skip("this CPU has no AVX512-BF16: no int4_linear, so no fused decode step (the Python layers run)")
    return ops


def _generate(llm: LLM, fused: bool, prompts: list[list[int]]):
    model = llm.engine.model_runner.model
    stack = model.decode_stack
    calls = []
    if not fused:
        model.decode_stack = None
    else:
        class Counting:  # the real stack, its calls counted
            def forward(self, *args):
                calls.append(args[0].shape[0])
                return stack.forward(*args)
        model.decode_stack = Counting()
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        outs = llm.generate(prompts, params)
    finally:
        model.decode_stack = stack
    return [(o.token_ids, o.logprobs) for o in outs], calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_decode_equals_the_python_layers_bit_for_bit(int4_ops, smollm_dir, dtype):
    llm = LLM(str(smollm_dir), dtype=dtype, quantization="int4", kv_cache_memory_gib=0.1, max_num_seqs=20)
    assert llm.engine.model_runner.model.decode_stack is not None
    prompts = [llm.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "1, 2, 3,")]
    limit = llm.engine.model_runner.model.fused_max_rows  # 16; 4 for bf16 where oneDNN has AMX
    assert llm.engine.labels()["quantized_decode_rows"] == str(limit)
    for batch in (prompts[:1], prompts, prompts * 2, prompts * 6):  # 1, 3, 6 and 18 decodes
        fused, calls = _generate(llm, True, batch)
        python, _ = _generate(llm, False, batch)
        assert fused == python
        if len(batch) <= limit:  # it ran every decode of the batch at once
            assert calls and max(calls) == len(batch)
        else:  # past the int4 kernels' rows the Python layers run the dense weights
            assert not calls or max(calls) <= limit


def test_the_python_layers_run_where_the_stack_cannot(smollm_dir):
    # Portable kernels, batch-invariant mode, unquantized: no stack.
    for kwargs in ({"quantization": "none"}, {"quantization": "int4", "batch_invariant": True}):
        llm = LLM(str(smollm_dir), dtype="bfloat16", kv_cache_memory_gib=0.05, **kwargs)
        assert llm.engine.model_runner.model.decode_stack is None, kwargs
        out = llm.generate([llm.tokenizer.encode("Hello")], SamplingParams(temperature=0, max_tokens=3))
        assert len(out[0].token_ids) == 3


def test_int4_hands_rows_to_the_amx_gemm_past_its_crossover(monkeypatch):
    amx = CpuInfo("Intel Xeon", "AVX512", frozenset({"amx_bf16", "avx512_bf16", "avx512bw"}), onednn_bf16=True)
    no_amx = CpuInfo("AMD EPYC", "AVX512", frozenset({"avx512_bf16", "avx512bw"}), onednn_bf16=True)
    assert max_int4_rows(amx) == MAX_INT4_ROWS_AMX < MAX_QUANTIZED_ROWS == max_int4_rows(no_amx)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # oneDNN capped below AMX
    assert max_int4_rows(amx) == MAX_QUANTIZED_ROWS
