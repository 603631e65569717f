"""The fused decode step (models/decode_stack.py): where it runs, a decode step's numbers are the
Python layers' bit for bit; where it cannot, the Python layers run."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.quantization import native_int4_kernel


@pytest.fixture(scope="module")
def int4_ops(ops):
    if native_int4_kernel(ops) is None:
        pytest.skip("this CPU has no AVX512-BF16: no int4_linear, so no fused decode step (the Python layers run)")
    return ops


class _Recorded:
    """The real stack, each call's rows and its start and end (perf_counter) recorded: how the
    decodes were batched, and whether another thread ran inside a call."""

    def __init__(self, stack) -> None:
        self.stack, self.rows, self.spans = stack, [], []

    def forward(self, *args):
        self.rows.append(args[0].shape[0])
        start = time.perf_counter()
        try:
            return self.stack.forward(*args)
        finally:
            self.spans.append((start, time.perf_counter()))


def _generate(llm: LLM, fused: bool, prompts: list[list[int]]):
    model = llm.engine.model_runner.model
    stack = model.decode_stack
    recorded = _Recorded(stack)
    model.decode_stack = recorded if fused else None
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        outs = llm.generate(prompts, params)
    finally:
        model.decode_stack = stack
    return [(o.token_ids, o.logprobs) for o in outs], recorded.rows


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_decode_equals_the_python_layers_bit_for_bit(int4_ops, smollm_dir, dtype):
    llm = LLM(str(smollm_dir), dtype=dtype, quantization="int4", kv_cache_memory_gib=0.1, max_num_seqs=20)
    assert llm.engine.model_runner.model.decode_stack is not None
    prompts = [llm.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "1, 2, 3,")]
    for batch in (prompts[:1], prompts, prompts * 6):  # 1, 3 and 18 decodes (past the int4 kernel's 16 rows)
        fused, calls = _generate(llm, True, batch)
        python, _ = _generate(llm, False, batch)
        assert fused == python
        if len(batch) <= 16:  # it ran every decode of the batch at once
            assert calls and max(calls) == len(batch)


def test_the_python_layers_run_where_the_stack_cannot(smollm_dir):
    # Portable kernels, batch-invariant mode, unquantized: no stack.
    for kwargs in ({"quantization": "none"}, {"quantization": "int4", "batch_invariant": True}):
        llm = LLM(str(smollm_dir), dtype="bfloat16", kv_cache_memory_gib=0.05, **kwargs)
        assert llm.engine.model_runner.model.decode_stack is None, kwargs
        out = llm.generate([llm.tokenizer.encode("Hello")], SamplingParams(temperature=0, max_tokens=3))
        assert len(out[0].token_ids) == 3


def test_the_fused_step_lets_other_threads_run(int4_ops, smollm_dir):
    # A node's HTTP event loop and KV side channels share the process with its engine thread: a
    # decode step that held the GIL stopped them for the whole step (a stream's chunks waited).
    llm = LLM(str(smollm_dir), dtype="bfloat16", quantization="int4", kv_cache_memory_gib=0.1, max_num_seqs=16)
    model = llm.engine.model_runner.model
    windows = _Recorded(model.decode_stack)
    model.decode_stack = windows
    prompts = [llm.tokenizer.encode(f"Count to {n}:") for n in range(8)]
    done, ticks = threading.Event(), []
    worker = threading.Thread(target=lambda: (llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                                   ignore_eos=True)), done.set()))
    worker.start()
    while not done.is_set():  # a Python thread that wants the GIL every millisecond
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    # Held, the ticker can run inside a call only once: when the call returns the GIL passes to the
    # waiting ticker before the call's end is recorded. Released, each step (tens of ms) lets many through.
    ticks_inside = [sum(start < t < end for t in ticks) for start, end in windows.spans]
    assert len(ticks_inside) >= 20
    assert sum(n >= 2 for n in ticks_inside) >= len(ticks_inside) / 2, ticks_inside
