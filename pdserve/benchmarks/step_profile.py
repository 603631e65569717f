"""Where a decode step's time goes (`python -m pdserve.benchmarks.engine --breakdown`).

For a batch of sequences decoding at a given context: the step's wall time (engine.step, no
profiler), then the same steps under torch's profiler, each op's own CPU time summed by kind
(GEMMs, attention, KV writes, norms / rope / activations, sampling, other ops; pdserve's C++ kernels
are timed as annotations, since the profiler does not see into them), and what is left of the wall
time: Python and framework overhead (scheduling, metadata, dispatch, the profiler-free gaps). And
each decoder layer's wall time (hooks around the Python layers, a run of its own: a fused decode step,
models/decode_stack.py, has no layer boundary Python sees).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from types import ModuleType
from typing import Any, Iterator

import torch

from pdserve.benchmarks.rooflines import streamed_weights
from pdserve.models.native import native_ops
from pdserve.models.quantization import NativeInt4Weight
from pdserve.sampling_params import SamplingParams
from pdserve.workload import random_prompts

HEADROOM = 256  # output tokens each sequence may take (the longest measured point uses ~80)
KINDS = ("gemm", "attention", "kv_write", "norm_rope_act", "sampling", "other_ops")
# Substrings of op names (aten's and the native annotations') by kind, checked in this order.
_KIND_NAMES = (
    ("gemm", ("linear", "addmm", "::mm", "bmm", "matmul", "int4pack", "int8pack", "mkldnn", "int8_head", "int4_linear")),
    ("attention", ("scaled_dot_product", "flash_attention", "paged_decode_attention", "index_select")),
    ("kv_write", ("index_copy",)),
    ("norm_rope_act", ("rms_norm", "rotary", "gelu", "silu", "tanh", "aten::mul", "aten::add", "aten::rsqrt",
                       "aten::pow", "aten::mean")),
    ("sampling", ("argmax", "topk", "sort", "softmax", "multinomial")),
)


def op_kind(name: str) -> str:
    for kind, parts in _KIND_NAMES:
        if any(part in name for part in parts):
            return kind
    return "other_ops"


class AnnotatedOps:
    """pdserve's C++ kernels, each call wrapped in a profiler annotation (`native::name`)."""

    def __init__(self, ops: ModuleType) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._ops, name)

        def annotated(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"native::{name}"):
                return fn(*args, **kwargs)

        return annotated


@contextlib.contextmanager
def annotated_native(engine) -> Iterator[None]:
    """Route the model's and the runner's C++ kernel calls through AnnotatedOps while profiled (the
    wrappers cost a few microseconds a call: the wall time is measured without them)."""
    runner = engine.model_runner
    saved: list[tuple[Any, str, Any]] = []
    for module in runner.model.modules():
        ops = getattr(module, "native", None)
        if isinstance(ops, ModuleType):
            saved.append((module, "native", ops))
            module.native = AnnotatedOps(ops)
        weight = getattr(module, "quantized", None)
        if isinstance(weight, NativeInt4Weight):
            saved.append((weight, "kernel", weight.kernel))
            weight.kernel = AnnotatedOps(native_ops()).int4_linear
    if runner.decode_kernel is not None:
        saved.append((runner, "decode_kernel", runner.decode_kernel))
        runner.decode_kernel = AnnotatedOps(native_ops()).paged_decode_attention
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _decode_steps(engine, n: int, batch: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if engine._decode_batch is None or engine._decode_batch[0] != batch:  # noqa: SLF001
            raise RuntimeError(f"a step ran {engine._decode_batch} instead of {batch} decodes (KV pool too small?)")
    return times


def breakdown(llm, batch: int, context: int, steps: int = 12) -> dict:
    """One (batch, context) point: milliseconds per decode step, by kind and by layer."""
    engine = llm.engine
    # Enough tokens that none ends while measured (the first prompts of a chunked prefill decode
    # while the others prefill): the rest are aborted at the end.
    params = SamplingParams(temperature=0, max_tokens=HEADROOM, ignore_eos=True)
    for prompt in random_prompts(batch, context, 1000 + batch + context):
        engine.add_request(prompt, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()  # the prompts' prefill: not profiled
    _decode_steps(engine, 3, batch)  # warm up
    wall = statistics.median(_decode_steps(engine, steps, batch))

    # Each layer's time, by hooks on the Python layers (a fused decode step has no layer boundary
    # Python sees: those steps run the Python layers here, so layer times are theirs).
    model = engine.model_runner.model
    stack, model.decode_stack = model.decode_stack, None
    layer_times: dict[int, list[float]] = {}
    starts: dict[int, float] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, time.perf_counter())))
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: layer_times.setdefault(i, []).append(time.perf_counter() - starts[i])))
    _decode_steps(engine, steps, batch)
    for hook in hooks:
        hook.remove()
    model.decode_stack = stack

    with annotated_native(engine), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = sum(_decode_steps(engine, steps, batch)) / steps
    by_kind = dict.fromkeys(KINDS, 0.0)
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep"):
            continue
        by_kind[op_kind(event.key)] += event.self_cpu_time_total / 1e3 / steps  # ms per step
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    ms = {kind: round(v, 3) for kind, v in by_kind.items()}
    ms["overhead"] = round(max(0.0, wall * 1e3 - sum(by_kind.values())), 3)
    layers = [statistics.median(layer_times[i]) * 1e3 for i in sorted(layer_times)]
    return {"batch": batch, "context": context, "step_ms": round(wall * 1e3, 3),
            "profiled_step_ms": round(profiled * 1e3, 3), "ms": ms,
            "layer_ms": [round(t, 3) for t in layers], "layers_sum_ms": round(sum(layers), 3)}


def profile_decode(model: str | None, dtype: str, quantization: str, batches: tuple[int, ...],
                   contexts: tuple[int, ...], block_size: int = 16) -> dict:
    """Every (batch, context) point for one engine configuration (KV blocks of `block_size` tokens)."""
    from pdserve import LLM

    longest = max(contexts) + HEADROOM
    llm = LLM(model, dtype=dtype, quantization=quantization, enable_prefix_caching=False, block_size=block_size,
              max_num_seqs=max(batches), max_model_len=longest,
              num_kv_blocks=max(batches) * -(-longest // block_size) + 64)  # every sequence's KV at once
    breakdown(llm, batches[0], contexts[0])  # warm up: the first steps after loading run slow
    points = [breakdown(llm, batch, context) for context in contexts for batch in batches]
    engine = llm.engine
    params, weight_bytes = streamed_weights(engine.model_runner.model, engine.plan.torch_dtype)
    return {"engine": engine.labels(), "points": points, "streamed_params": params, "weight_bytes": weight_bytes,
            "kv_bytes_per_token": engine.kv_spec.bytes_per_token, "block_size": block_size}


def step_bytes(config: dict, batch: int, context: int) -> int:
    """What a decode step must read: the weights as served, and each sequence's KV at its context."""
    return config["weight_bytes"] + batch * context * config["kv_bytes_per_token"]


def roofline_lines(configs: dict[str, dict], rooflines: dict) -> list[str]:
    """Each configuration's decode against the machine: batch 1 against the time its bytes take at the
    read bandwidth, and the cost of each extra sequence against a token's FLOPs at the GEMM rate."""
    lines = []
    for name, config in configs.items():
        dtype = config["engine"]["dtype"]
        gflops = rooflines["gemm_gflops"].get(dtype)
        token_ms = 2 * config["streamed_params"] / (gflops * 1e9) * 1e3 if gflops else None
        by_point = {(p["batch"], p["context"]): p["step_ms"] for p in config["points"]}
        for context in sorted({c for _, c in by_point}):
            steps = {b: ms for (b, c), ms in by_point.items() if c == context}
            if 1 in steps:
                limit = step_bytes(config, 1, context) / (rooflines["read_bandwidth_gbs"] * 1e9) * 1e3
                lines.append(f"- {name}, context {context}: batch 1 reads {step_bytes(config, 1, context) / 2**20:.0f} MiB "
                             f"a step, {limit:.2f} ms at the read bandwidth; the step takes {steps[1]:.2f} ms: "
                             f"{limit / steps[1]:.2f}x the memory roofline")
            batches = sorted(steps)
            extra = [f"{a} -> {b}: {(steps[b] - steps[a]) / (b - a):.2f} ms" for a, b in zip(batches, batches[1:])]
            if extra and token_ms:
                lines.append(f"- {name}, context {context}: each extra sequence costs " + ", ".join(extra)
                             + f"; a token's {2 * config['streamed_params'] / 1e9:.2f} GFLOP take {token_ms:.2f} ms "
                             f"at the {dtype} GEMM rate ({gflops:.0f} GFLOP/s)")
    return lines


def markdown(configs: dict[str, dict]) -> list[str]:
    lines = ["| engine | batch | context | step ms | GEMM | attention | KV write | norm/rope/act | sampling | "
             "other ops | overhead | Python layers (min / median / max ms) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, config in configs.items():
        for p in config["points"]:
            ms, layers = p["ms"], p["layer_ms"]
            cells = " | ".join(f"{ms[k]:.2f}" for k in (*KINDS, "overhead"))
            lines.append(f"| {name} | {p['batch']} | {p['context']} | {p['step_ms']:.2f} | {cells} | "
                         f"{min(layers):.2f} / {statistics.median(layers):.2f} / {max(layers):.2f} |")
    return lines
