"""pdserve's C++ kernels alone, on SmolLM2's shapes, against what the engine would run without them:
`python -m pdserve.benchmarks.engine --kernels`.

- int4 projection: 30 layers' gate/up (3072 x 576, 30 distinct weights, as a step streams them) at
  1 / 2 / 4 / 8 / 16 rows: `int4_linear` (AVX512-BF16 CPUs; where the CPU has AMX, also without its
  tiles: `int4_linear_avx512`), torch's int4 kernel, oneDNN bf16 on the dequantized weight.
- Decode attention: 30 layers' bf16 KV (9 query heads, 3 KV heads of 64; blocks of 16 tokens, the
  engine's default, and of 32, scattered as a pool leaves them), 1 x 2048, 8 x 2048 and 8 x 128 keys:
  the C++ kernel, and the GB/s of KV it reads.
- Prefill attention: one layer's causal attention over a 512- and a 2048-token prompt (9 heads, 3 KV
  heads of 64, bf16): `prefill_attention` (AVX512-BF16 CPUs) against torch's SDPA on the same
  tensors (what the engine runs without it), in ms and in GFLOP/s of the causal half.
- The int8 output head (49152 x 576, Q8_0 groups) at 1 / 4 / 8 / 16 rows: `int8_head` (where the CPU
  has AMX, also without its tiles: `int8_head_avx512`) against float32 F.linear on the dequantized weight.
Each figure is the median of `repeats` timed calls after one warm-up, in milliseconds.
"""

from __future__ import annotations

import statistics
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

from pdserve.benchmarks.timing import median_ms
from pdserve.models.quantization import INT8_GROUP, native_int4_kernel, quantize_int4, quantize_int8_groups

LAYERS = 30
HIDDEN, GATE_UP, VOCAB = 576, 3072, 49152
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BLOCK_SIZES = (16, 32)  # tokens a block: the engine's default (--block-size), and twice its K / V runs
INT4_ROWS = (1, 2, 4, 8, 16)
ATTENTION_CASES = ((1, 2048), (8, 2048), (8, 128))
HEAD_ROWS = (1, 4, 8, 16)
PREFILL_TOKENS = (512, 2048)


def int4_projection(ops: ModuleType, repeats: int) -> dict:
    torch.manual_seed(0)
    weights = [torch.randn(GATE_UP, HIDDEN) * 0.05 for _ in range(LAYERS)]
    native_kernel = native_int4_kernel(ops)
    native = [quantize_int4(w, native_kernel)[0] for w in weights] if native_kernel else None
    torch_int4, dense = [], []
    for w in weights:
        quantized, dequantized = quantize_int4(w)
        torch_int4.append(quantized)
        dense.append(torch.ops.mkldnn._reorder_linear_weight(dequantized.bfloat16()))
    results = {}
    for rows in INT4_ROWS:
        x = torch.randn(rows, HIDDEN).bfloat16()
        entry = {"torch_int4": median_ms(lambda: [q(x) for q in torch_int4], repeats),
                 "onednn_bf16": median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                   for w in dense], repeats)}
        if native is not None:
            entry["int4_linear"] = median_ms(lambda: [q(x) for q in native], repeats)
            if ops.amx_available():  # the same kernel without its AMX tiles, to see what they buy
                entry["int4_linear_avx512"] = without_amx(ops, lambda: median_ms(lambda: [q(x) for q in native], repeats))
        results[str(rows)] = entry
    int4_bytes = sum(q.nbytes for q in torch_int4)
    return {"rows": results, "int4_mib": int4_bytes / 2**20}


def attention_case(block: int, batch: int, context: int, scattered: bool = True) -> tuple:
    """30 layers' bf16 KV pools of blocks of `block` tokens holding `batch` sequences of `context`
    keys, their block tables (scattered over the pool, as churn leaves them, or in address order),
    and the kernel's other arguments: (caches, tables, lens, query, out, partition_blocks)."""
    each = -(-context // block)
    pool = batch * each + 1
    caches = [torch.randn(2, pool, block, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(LAYERS)]
    ids = torch.randperm(pool - 1) if scattered else torch.arange(pool - 1)
    query = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    # As the engine sizes partitions (model_runner._kernel_group): 4 units a thread, at least 8 blocks.
    partition = max(8, -(-each // -(-4 * torch.get_num_threads() // batch)))
    return (caches, ids[: batch * each].reshape(batch, each) + 1, torch.full((batch,), context, dtype=torch.int64),
            query, torch.empty_like(query), partition)


def attend_ms(ops: ModuleType, case: tuple, repeats: int) -> float:
    caches, tables, lens, query, out, partition = case
    return median_ms(lambda: [ops.paged_decode_attention(query, kv, tables, lens, out, HEAD_DIM ** -0.5, partition, 0)
                              for kv in caches], repeats)


def attention(ops: ModuleType, repeats: int) -> dict:
    torch.manual_seed(0)
    results = {}
    for block in BLOCK_SIZES:
        for batch, context in ATTENTION_CASES:
            ms = attend_ms(ops, attention_case(block, batch, context), repeats)
            kv_bytes = LAYERS * batch * context * 2 * KV_HEADS * HEAD_DIM * 2
            results[f"{batch}x{context}" + (f" (blocks of {block})" if block != BLOCK_SIZES[0] else "")] = {
                "ms": ms, "kv_gbs": kv_bytes / ms / 1e6, "block_size": block}
    return results


def prefill_attention(ops: ModuleType, repeats: int) -> dict:
    torch.manual_seed(0)
    results = {}
    for tokens in PREFILL_TOKENS:
        q = torch.randn(tokens, HEADS, HEAD_DIM).bfloat16()
        k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))
        out, scale = torch.empty_like(q), HEAD_DIM ** -0.5
        # SDPA as models/attention.py calls it: [1, heads, tokens, D] views of the same rows.
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        entry = {"sdpa_ms": median_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                                             enable_gqa=True), repeats)}
        if hasattr(ops, "prefill_attention"):
            entry["kernel_ms"] = median_ms(lambda: ops.prefill_attention(q, k, v, out, scale), repeats)
        flops = 4 * HEADS * HEAD_DIM * tokens * (tokens + 1) / 2  # QK and PV over the keys each query sees
        results[str(tokens)] = {**entry, **{kind.replace("_ms", "_gflops"): flops / ms / 1e6
                                            for kind, ms in entry.items()}}
    return results


PREFETCH_TOKENS = (0, 16, 32, 64, 128)  # 0: none; 32 the kernel's default (set_prefetch_tokens)
PREFETCH_CASES = ((1, 2048, True), (8, 2048, True), (8, 128, True), (1, 2048, False), (8, 2048, False))


def prefetch_sweep(ops: ModuleType, rounds: int = 3, repeats: int = 10) -> dict:
    """Decode attention (30 layers, as `attention`) by block size and prefetch distance in tokens,
    KV blocks scattered over the pool (a server after churn) or in address order (a fresh one). All
    pools are built first and the distances alternate for `rounds` rounds in one process, so that
    the host's drift falls on every cell; each cell is the median of its rounds."""
    torch.manual_seed(0)
    setups = {f"blocks of {block}, {batch}x{context}, {'scattered' if scattered else 'in order'}":
              attention_case(block, batch, context, scattered)
              for block in BLOCK_SIZES for batch, context, scattered in PREFETCH_CASES}
    cells: dict[str, dict[str, list[float]]] = {name: {str(t): [] for t in PREFETCH_TOKENS} for name in setups}
    previous = ops.set_prefetch_tokens(PREFETCH_TOKENS[0])
    try:
        for _ in range(rounds):
            for tokens in PREFETCH_TOKENS:
                ops.set_prefetch_tokens(tokens)
                for name, case in setups.items():
                    cells[name][str(tokens)].append(attend_ms(ops, case, repeats))
    finally:
        ops.set_prefetch_tokens(previous)
    return {name: {t: statistics.median(v) for t, v in row.items()} for name, row in cells.items()}


def prefetch_markdown(sweep: dict) -> list[str]:
    lines = ["| pool, batch x keys | " + " | ".join(f"prefetch {t}" if t else "no prefetch" for t in PREFETCH_TOKENS)
             + " |", "|---" * (len(PREFETCH_TOKENS) + 1) + "|"]
    return lines + [f"| {name} | " + " | ".join(f"{row[str(t)]:.2f}" for t in PREFETCH_TOKENS) + " |"
                    for name, row in sweep.items()]


def int8_head(ops: ModuleType, repeats: int) -> dict:
    torch.manual_seed(0)
    head = quantize_int8_groups(torch.randn(VOCAB, HIDDEN) * 0.05)
    dequantized = (head.codes.float().reshape(VOCAB, -1, INT8_GROUP) * head.scales.unsqueeze(-1)).reshape(VOCAB, HIDDEN)
    results = {}
    for rows in HEAD_ROWS:
        x = torch.randn(rows, HIDDEN)
        entry = {"int8_head": median_ms(lambda: ops.int8_head(x, head.codes, head.scales), repeats),
                 "float32_linear": median_ms(lambda: F.linear(x, dequantized), repeats)}
        if ops.amx_available():
            entry["int8_head_avx512"] = without_amx(ops, lambda: median_ms(
                lambda: ops.int8_head(x, head.codes, head.scales), repeats))
        results[str(rows)] = entry
    return results


def without_amx(ops: ModuleType, measure: Callable[[], float]) -> float:
    """`measure` with pdserve's kernels off AMX's tiles (on AVX-512 alone)."""
    previous = ops.set_amx(False)
    try:
        return measure()
    finally:
        ops.set_amx(previous)


def run(ops: ModuleType, repeats: int = 20) -> dict:
    return {"int4_projection": int4_projection(ops, repeats), "attention": attention(ops, repeats),
            "prefill_attention": prefill_attention(ops, max(3, repeats // 4)), "int8_head": int8_head(ops, repeats)}


def markdown(results: dict) -> list[str]:
    int4, rows = results["int4_projection"], results["int4_projection"]["rows"]
    kinds = [k for k in ("int4_linear", "int4_linear_avx512", "torch_int4", "onednn_bf16") if k in rows[str(INT4_ROWS[0])]]
    lines = [f"int4 projection, {LAYERS} x gate/up ({GATE_UP} x {HIDDEN}; {int4['int4_mib']:.1f} MiB of int4), ms:", "",
             "| rows | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    lines += [f"| {r} | " + " | ".join(f"{rows[r][k]:.2f}" for k in kinds) + " |" for r in rows]
    lines += ["", f"Decode attention, {LAYERS} layers, bf16 KV ({HEADS} heads, {KV_HEADS} KV heads of {HEAD_DIM}):", "",
              "| batch x context | ms | KV read GB/s |", "|---|---|---|"]
    lines += [f"| {case} | {v['ms']:.2f} | {v['kv_gbs']:.1f} |" for case, v in results["attention"].items()]
    prefill = results["prefill_attention"]
    lines += ["", f"Prefill attention, one layer, causal, bf16 ({HEADS} heads, {KV_HEADS} KV heads of {HEAD_DIM}):", "",
              "| prompt tokens | kernel ms | kernel GFLOP/s | SDPA ms | SDPA GFLOP/s |", "|---|---|---|---|---|"]
    lines += [f"| {t} | {v.get('kernel_ms', float('nan')):.2f} | {v.get('kernel_gflops', float('nan')):.0f} | "
              f"{v['sdpa_ms']:.2f} | {v['sdpa_gflops']:.0f} |" for t, v in prefill.items()]
    head = results["int8_head"]
    head_kinds = [k for k in ("int8_head", "int8_head_avx512", "float32_linear") if k in head[str(HEAD_ROWS[0])]]
    lines += ["", f"Output head ({VOCAB} x {HIDDEN}), ms:", "", "| rows | " + " | ".join(head_kinds) + " |",
              "|---" * (len(head_kinds) + 1) + "|"]
    lines += [f"| {r} | " + " | ".join(f"{v[k]:.2f}" for k in head_kinds) + " |" for r, v in head.items()]
    return lines
