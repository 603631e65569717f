"""Engine benchmark: pdserve against transformers on SmolLM2, same threads and dtype, one run.

    python -m pdserve.benchmarks.engine [--threads 1] [--dtypes float32 bfloat16] [--quantizations int4] [--quick]
        [--model gemma-3-270m --section engine_gemma3 --out docs/results/engine_gemma3.json]

    # the portable path as on an AVX2-only CPU, into its own section and file:
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PDSERVE_KERNELS=portable \
        python -m pdserve.benchmarks.engine --dtypes float32 --section engine_avx2 --out docs/results/engine_avx2.json

The float columns run unquantized (the same weights as transformers); each of --quantizations adds a
pdserve column with that weight-only quantization on the default dtype (`int4` is what `auto` serves
for the embedded Q4_1 GGUF). Each column runs in a fresh subprocess so that memory figures are its own. Measures
prefill tok/s (512-token prompt), decode tok/s at batch 1/8/32 (128-token prompts), offline
throughput for 8 x 512 -> 128 and 1 x 2048 -> 64, KV bytes per token and RSS. For pdserve also
the memory bound of decode: the read bandwidth measured in the same process, the weights a step
streams and the batch-1 limit that sets per weight format (float32, bfloat16, int8, int4), the
effective GB/s of each decode figure, and the decode step against context (32 to 4096 tokens).
Writes `docs/results/engine.json` and the engine table in `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from pdserve.benchmarks import kernels
from pdserve.benchmarks.report import publish
from pdserve.benchmarks.rooflines import (
    BANDWIDTH_MIB,
    GEMM_SHAPE,
    gemm_gflops,
    read_bandwidth_gbs,
    streamed_weights,
)
from pdserve.benchmarks.step_profile import markdown as step_markdown
from pdserve.benchmarks.step_profile import profile_decode, roofline_lines
from pdserve.models.locate import default_model_name
from pdserve.platform import CPU_ENV, CpuInfo
from pdserve.procinfo import rss_mib
from pdserve.workload import random_prompts

DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT_LEN, DECODE_STEPS = 128, 32
DECODE_MEDIAN_CONTEXT = DECODE_PROMPT_LEN + DECODE_STEPS // 2  # the context of the median decode step
OFFLINE_SHAPES = ((8, 512, 128), (1, 2048, 64))
STEP_CONTEXTS = (32, 256, 1024, 2048, 4096)  # decode step time against context, batch 1
# Weight bytes per parameter of each format: the floor of a batch-1 decode step is streaming them.
WEIGHT_FORMATS = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- pdserve ------------------------------------------------------------------------------------


def bench_pdserve(model: str | None, dtype: str, quantization: str, quick: bool,
                  step_contexts: tuple[int, ...] = STEP_CONTEXTS) -> dict:
    from pdserve import LLM, SamplingParams

    bandwidth = read_bandwidth_gbs()  # before the model: its buffer must not count in the peak RSS
    llm = LLM(model, dtype=dtype, quantization=quantization)
    plan = llm.engine.plan
    result = {"engine": llm.engine.labels(), "rss_after_load_mib": rss_mib(),
              "kv_bytes_per_token": llm.engine.kv_spec.bytes_per_token}
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate(random_prompts(2, 64, 0), greedy(4))  # warm up

    prompt = random_prompts(1, 512, 1)
    times = []
    for _ in range(1 if quick else 3):
        start = time.perf_counter()
        llm.generate(prompt, greedy(1))
        times.append(time.perf_counter() - start)
        prompt = [[t + 1 for t in prompt[0]]]  # a new prompt: no prefix-cache hit
    result["prefill_512_tok_s"] = 512 / min(times)

    for batch in DECODE_BATCHES:
        outs = llm.generate(random_prompts(batch, DECODE_PROMPT_LEN, 10 + batch), greedy(DECODE_STEPS + 1))
        step = statistics.median(itl for o in outs for itl in o.metrics.inter_token_latencies)
        result[f"decode_b{batch}_tok_s"] = batch / step
        result[f"decode_b{batch}_step_ms"] = step * 1e3

    # What a decode step must read: the weights, plus each sequence's KV at its context.
    model = llm.engine.model_runner.model
    params, weight_bytes = streamed_weights(model, plan.torch_dtype)
    result.update(read_bandwidth_gbs=bandwidth, streamed_params=params, weight_bytes=weight_bytes)
    result["weight_streaming_limit_tok_s"] = {f: bandwidth * 1e9 / (params * b) for f, b in WEIGHT_FORMATS.items()}
    kv = llm.engine.kv_spec.bytes_per_token
    for batch in DECODE_BATCHES:
        read = weight_bytes + batch * DECODE_MEDIAN_CONTEXT * kv
        result[f"decode_b{batch}_effective_gbs"] = read / (result[f"decode_b{batch}_step_ms"] / 1e3) / 1e9

    contexts = step_contexts[:3] if quick else step_contexts
    result["decode_step_ms_by_context"] = {}
    for i, context in enumerate(contexts):
        [out] = llm.generate(random_prompts(1, context, 200 + i), greedy(9))
        result["decode_step_ms_by_context"][str(context)] = statistics.median(out.metrics.inter_token_latencies) * 1e3

    for n, inp, outp in OFFLINE_SHAPES[:1] if quick else OFFLINE_SHAPES:
        start = time.perf_counter()
        llm.generate(random_prompts(n, inp, 100 + inp), greedy(outp))
        elapsed = time.perf_counter() - start
        result[f"offline_{n}x{inp}_{outp}_output_tok_s"] = n * outp / elapsed
        result[f"offline_{n}x{inp}_{outp}_total_tok_s"] = n * (inp + outp) / elapsed
    result["peak_rss_mib"] = peak_rss_mib()
    return result


# -- transformers -------------------------------------------------------------------------------


def bench_transformers(model_name: str | None, dtype: str, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from pdserve.models.locate import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name), dtype=getattr(torch, dtype)).eval()
    cpu = CpuInfo.detect()
    result = {"engine": {"device": "cpu", "device_name": cpu.model, "isa": cpu.isa, "dtype": dtype,
                         "kernels": "eager"}, "rss_after_load_mib": rss_mib()}

    @torch.inference_mode()
    def prefill_time(prompt):
        start = time.perf_counter()
        model(input_ids=torch.tensor(prompt), logits_to_keep=1)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode_step_time(prompts):
        out = model(input_ids=torch.tensor(prompts), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(DECODE_STEPS):
            start = time.perf_counter()
            out = model(input_ids=token, cache=out.cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - start)
        return statistics.median(steps)

    @torch.inference_mode()
    def generate_time(prompts, n):
        start = time.perf_counter()
        model.generate(torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    prefill_time(random_prompts(1, 64, 0))  # warm up
    prompt = random_prompts(1, 512, 1)
    result["prefill_512_tok_s"] = 512 / min(prefill_time(prompt) for _ in range(1 if quick else 3))
    for batch in DECODE_BATCHES:
        step = decode_step_time(random_prompts(batch, DECODE_PROMPT_LEN, 10 + batch))
        result[f"decode_b{batch}_tok_s"] = batch / step
        result[f"decode_b{batch}_step_ms"] = step * 1e3
    for n, inp, outp in OFFLINE_SHAPES[:1] if quick else OFFLINE_SHAPES:
        elapsed = generate_time(random_prompts(n, inp, 100 + inp), outp)
        result[f"offline_{n}x{inp}_{outp}_output_tok_s"] = n * outp / elapsed
        result[f"offline_{n}x{inp}_{outp}_total_tok_s"] = n * (inp + outp) / elapsed
    result["peak_rss_mib"] = peak_rss_mib()
    return result


# -- orchestration ------------------------------------------------------------------------------


def run_one(args: argparse.Namespace, system: str, dtype: str, quantization: str = "none") -> dict:
    """Run one (system, dtype, quantization) in a subprocess pinned to `args.threads` torch threads."""
    threads = args.threads
    cmd = [sys.executable, "-m", "pdserve.benchmarks.engine", "--only", system, "--dtypes", dtype,
           "--quantizations", quantization, "--threads", str(threads),
           "--step-contexts", *map(str, args.step_contexts)] + (["--quick"] if args.quick else [])
    if args.model is not None:
        cmd += ["--model", args.model]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    print(f"  running {system} {dtype} {quantization} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


METRICS = [
    ("prefill_512_tok_s", "prefill tok/s (512-token prompt)"),
    ("decode_b1_tok_s", "decode tok/s, batch 1"),
    ("decode_b8_tok_s", "decode tok/s, batch 8"),
    ("decode_b32_tok_s", "decode tok/s, batch 32"),
    ("offline_8x512_128_output_tok_s", "offline 8 x 512 -> 128, output tok/s"),
    ("offline_8x512_128_total_tok_s", "offline 8 x 512 -> 128, total tok/s"),
    ("offline_1x2048_64_output_tok_s", "offline 1 x 2048 -> 64, output tok/s"),
    ("offline_1x2048_64_total_tok_s", "offline 1 x 2048 -> 64, total tok/s"),
    ("peak_rss_mib", "peak RSS (MiB)"),
]


def markdown(results: dict, threads: int, dtypes: list[str], quantizations: list[str]) -> str:
    cols = [(s, d) for d in dtypes for s in ("pdserve", "transformers")] + [("pdserve", q) for q in quantizations]
    meta = results["meta"]
    env = " ".join(f"{k}={v}" for k, v in meta["env"].items())
    lines = [
        f"Command: `{env + ' ' if env else ''}python -m pdserve.benchmarks.engine --threads {threads}{meta['flags']}` "
        f"({meta['date']}, {threads} thread(s), {meta['model']}). Float columns unquantized; "
        + "".join(f"`{q}`: {q} weights on the default dtype ({results['pdserve'][q]['engine']['dtype']}). "
                  for q in quantizations),
        "",
        f"CPU: {meta['cpu']}, ISA {meta['isa']} (torch's dispatch level), torch {meta['torch']}. "
        "Kernel path per column: onednn = bf16 weights pre-packed for oneDNN, portable = torch's own "
        "operators, eager = transformers' own model.",
        "",
        "| metric | " + " | ".join(f"{s} {d} ({results[s][d]['engine']['kernels']})" for s, d in cols) + " |",
        # (a quantized column's kernels: its prefill path; its decode runs the int kernels)
        "|---|" + "---|" * len(cols),
    ]
    for key, label in METRICS:
        cells = [results[s][d].get(key) for s, d in cols]
        lines.append(f"| {label} | " + " | ".join("–" if c is None else f"{c:.0f}" for c in cells) + " |")
    lines.append("")
    for d in dtypes:
        p, t = results["pdserve"][d], results["transformers"][d]
        ratios = ", ".join(
            f"{k.removesuffix('_tok_s')} {p[k] / t[k]:.2f}x" for k in ("prefill_512_tok_s", "decode_b1_tok_s", "decode_b8_tok_s")
        )
        lines.append(f"- pdserve / transformers, {d}: {ratios}")
    if "float32" in dtypes:
        t32 = results["transformers"]["float32"]
        for d in dtypes + quantizations:
            p = results["pdserve"][d]
            lines.append(
                f"- pdserve {d} / transformers float32: decode b1 {p['decode_b1_tok_s'] / t32['decode_b1_tok_s']:.2f}x, "
                f"decode b8 {p['decode_b8_tok_s'] / t32['decode_b8_tok_s']:.2f}x, "
                f"prefill {p['prefill_512_tok_s'] / t32['prefill_512_tok_s']:.2f}x"
            )
    kv = {d: results["pdserve"][d]["kv_bytes_per_token"] for d in dtypes}
    lines.append("- KV cache bytes per token: " + ", ".join(f"{d} {v / 1024:.1f} KiB" for d, v in kv.items()))
    for d in dtypes + quantizations:
        lines += memory_bound_lines(d, results["pdserve"][d])
    return "\n".join(lines)


def memory_bound_lines(dtype: str, p: dict) -> list[str]:
    """How far pdserve's decode is from streaming its weights (and KV) at the measured bandwidth."""
    if "read_bandwidth_gbs" not in p:
        return []
    limits = p["weight_streaming_limit_tok_s"]
    steps = p["decode_step_ms_by_context"]
    first, longest = next(iter(steps)), list(steps)[-1]
    growth = f"; step at 2048 / step at {first} = {steps['2048'] / steps[first]:.2f}x" if "2048" in steps else ""
    return [
        f"- pdserve {dtype}: read bandwidth {p['read_bandwidth_gbs']:.1f} GB/s (summing {BANDWIDTH_MIB} MiB, same "
        f"process); a decode step streams {p['streamed_params'] / 1e6:.0f} M parameters, "
        f"{p['weight_bytes'] / 2**20:.0f} MiB in this format. Weight-streaming limit at batch 1: "
        + ", ".join(f"{f} {v:.1f}" for f, v in limits.items()) + " tok/s; "
        f"decode batch 1 reaches {p['decode_b1_tok_s'] / limits['float32']:.2f}x the float32 limit",
        f"- pdserve {dtype}, effective read GB/s of the decode figures (weights + KV at context "
        f"{DECODE_MEDIAN_CONTEXT}): "
        + ", ".join(f"batch {b} {p[f'decode_b{b}_effective_gbs']:.1f}" for b in DECODE_BATCHES),
        f"- pdserve {dtype}, decode step (ms) against context, batch 1: "
        + ", ".join(f"{c}: {ms:.1f}" for c, ms in steps.items()) + growth
        + (f" (up to {longest} tokens)" if not growth else ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--quantizations", nargs="*", default=["int4"], choices=["int4", "int8", "none"],
                        help="pdserve columns with weight-only quantization, on the default dtype")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shapes (a smoke run)")
    parser.add_argument("--model", default=None, help="a packaged model's name, a GGUF or a directory "
                                                      "(default: the embedded SmolLM2)")
    parser.add_argument("--step-contexts", type=int, nargs="+", default=list(STEP_CONTEXTS),
                        help="contexts of the decode step against context (batch 1)")
    parser.add_argument("--only", choices=["pdserve", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default="docs/results/engine.json")
    parser.add_argument("--section", default="engine", help="the section of docs/benchmarks.md to rewrite")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead: where a decode step's time goes, by op kind and by layer, at batch 1 / 8 / 32 "
                             "and context 128 / 2048, on the default path (and each of --dtypes given), into "
                             "docs/results/engine_breakdown.json and its section of docs/benchmarks.md")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16],
                        help="with --breakdown: the default path at each of these KV block sizes (tokens a block)")
    parser.add_argument("--prefetch-sweep", action="store_true",
                        help="with --kernels: decode attention by KV block size and prefetch distance instead, into "
                             "docs/results/attention_prefetch.json")
    parser.add_argument("--kernels", action="store_true",
                        help="instead: pdserve's C++ kernels alone on SmolLM2's shapes (int4 projection, decode "
                             "and prefill attention, int8 head) against torch's, into docs/results/engine_kernels.json")
    args = parser.parse_args()
    if args.breakdown:
        run_breakdown(args, explicit_dtypes="--dtypes" in sys.argv)
        return
    if args.kernels:
        run_kernels(args)
        return

    if args.only:  # child process: one system, one dtype, JSON on the last stdout line
        torch.set_num_threads(args.threads)
        if args.only == "pdserve":
            print(json.dumps(bench_pdserve(args.model, args.dtypes[0], args.quantizations[0], args.quick,
                                           tuple(args.step_contexts))))
        else:
            print(json.dumps(bench_transformers(args.model, args.dtypes[0], args.quick)))
        return

    cpu = CpuInfo.detect()
    results: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "cpu": cpu.model,
            "isa": cpu.isa,
            "onednn_bf16": cpu.onednn_bf16,
            "env": {k: os.environ[k] for k in CPU_ENV if os.environ.get(k)},
            "threads": args.threads,
            "torch": torch.__version__,
            "model": default_model_name(args.model),
            "flags": (f" --model {args.model}" if args.model else "")
                     + (f" --dtypes {' '.join(args.dtypes)}" if args.dtypes != ["float32", "bfloat16"] else "")
                     + (f" --quantizations {' '.join(args.quantizations)}" if args.quantizations != ["int4"] else "")
                     + (f" --step-contexts {' '.join(map(str, args.step_contexts))}"
                        if args.step_contexts != list(STEP_CONTEXTS) else ""),
        },
        "pdserve": {},
        "transformers": {},
    }
    for dtype in args.dtypes:
        for system in ("pdserve", "transformers"):
            results[system][dtype] = run_one(args, system, dtype)
    quantizations = [q for q in args.quantizations if q != "none"]
    for q in quantizations:
        results["pdserve"][q] = run_one(args, "pdserve", "auto", quantization=q)
    table = markdown(results, args.threads, args.dtypes, quantizations)
    if args.no_docs:
        print(table)
    else:
        env = ", ".join(f"{k}={v}" for k, v in results["meta"]["env"].items())
        title = "Engine: pdserve vs transformers" + (f", {results['meta']['model']}" if args.model else "") + (
            f" ({env})" if env else "")
        publish(results, args.out, args.section, title, table)


BREAKDOWN_BATCHES, BREAKDOWN_CONTEXTS = (1, 8, 32), (128, 2048)


def run_breakdown(args: argparse.Namespace, explicit_dtypes: bool) -> None:
    torch.set_num_threads(args.threads)
    cpu = CpuInfo.detect()
    configs = [("auto", "auto", block) for block in args.block_sizes]
    configs += [(d, "none", args.block_sizes[0]) for d in args.dtypes] if explicit_dtypes else []
    # The machine's rooflines, measured before the models load (same process and threads).
    rooflines = {"read_bandwidth_gbs": read_bandwidth_gbs(),
                 "gemm_gflops": {name: gemm_gflops(getattr(torch, name)) for name in ("bfloat16", "float32")}}
    results = {"rooflines": rooflines, "meta": {"date": time.strftime("%Y-%m-%d"), "cpu": cpu.model, "isa": cpu.isa,
                        "flags": sorted(f for f in cpu.flags if f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2")),
                        "threads": args.threads, "torch": torch.__version__, "model": default_model_name(args.model)},
               "configs": {}}
    for dtype, quantization, block in configs:
        config = profile_decode(args.model, dtype, quantization, BREAKDOWN_BATCHES, BREAKDOWN_CONTEXTS, block)
        labels = config["engine"]
        tiles = ", AMX tiles" if labels.get("amx_tiles") == "true" else ""
        blocks = f", blocks of {block}" if args.block_sizes != [16] else ""
        results["configs"][f"{labels['dtype']} + {labels['quantization']} ({labels['attention']}{tiles}{blocks})"] = config
    meta = results["meta"]
    lines = [f"Command: `python -m pdserve.benchmarks.engine --breakdown"
             f"{f' --model {args.model}' if args.model else ''}"
             f"{' --dtypes ' + ' '.join(args.dtypes) if explicit_dtypes else ''}"
             f"{' --block-sizes ' + ' '.join(map(str, args.block_sizes)) if args.block_sizes != [16] else ''}` "
             f"({meta['date']}; {meta['cpu']}, "
             f"{', '.join(meta['flags'])}; {args.threads} thread(s); {meta['model']}). Milliseconds per decode step: "
             "the step's wall time (engine.step, median of 12), then each kind's own op time under torch's profiler "
             "(pdserve's C++ kernels as annotations), and the overhead: wall time minus all ops (Python, scheduling, "
             "metadata, dispatch). Python layers: each decoder layer's wall time (hooks; a fused decode step "
             "has no layer boundary, so these are the Python layers'), min / median / max.", "",
             *step_markdown(results["configs"]), "",
             f"Rooflines (same process): read bandwidth {rooflines['read_bandwidth_gbs']:.1f} GB/s (summing "
             f"{BANDWIDTH_MIB} MiB); GEMM {' x '.join(map(str, GEMM_SHAPE))}: "
             + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in rooflines["gemm_gflops"].items()) + ".", "",
             *roofline_lines(results["configs"], rooflines)]
    if args.no_docs:
        print("\n".join(lines))
    else:
        publish(results, "docs/results/engine_breakdown.json", "engine_breakdown",
                "Engine: where a decode step's time goes (issue 35)", "\n".join(lines))


def run_kernels(args: argparse.Namespace) -> None:
    from pdserve.models.native import native_ops

    torch.set_num_threads(args.threads)
    ops = native_ops()
    if ops is None:
        sys.exit("pdserve's C++ kernels are not built here (see the warning above): nothing to measure")
    cpu = CpuInfo.detect()
    flags = sorted(f for f in cpu.flags if f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"))
    results = {"meta": {"date": time.strftime("%Y-%m-%d"), "cpu": cpu.model, "flags": flags, "threads": args.threads,
                        "torch": torch.__version__},
               "read_bandwidth_gbs": read_bandwidth_gbs()}
    if args.prefetch_sweep:
        results["attention_ms"] = kernels.prefetch_sweep(ops)
        lines = [f"Command: `python -m pdserve.benchmarks.engine --kernels --prefetch-sweep` "
                 f"({results['meta']['date']}; "
                 f"{cpu.model}, {', '.join(flags)}; {args.threads} thread(s); read bandwidth "
                 f"{results['read_bandwidth_gbs']:.1f} GB/s in the same process). Decode attention, 30 layers of bf16 KV "
                 f"(9 heads, 3 KV heads of 64), ms, by the pool's block size and how far ahead (tokens) the kernel "
                 "prefetches (32: its default); medians of 3 alternating rounds.", "",
                 *kernels.prefetch_markdown(results["attention_ms"])]
        if args.no_docs:
            print("\n".join(lines))
        else:
            publish(results, "docs/results/attention_prefetch.json", "attention_prefetch",
                    "Engine: decode attention by block size and prefetch distance (issue 35)", "\n".join(lines))
        return
    repeats = 5 if args.quick else 20
    results.update(kernels.run(ops, repeats))
    lines = [f"Command: `python -m pdserve.benchmarks.engine --kernels{' --quick' if args.quick else ''}` "
             f"({results['meta']['date']}; {cpu.model}, {', '.join(flags)}; {args.threads} thread(s); read bandwidth "
             f"{results['read_bandwidth_gbs']:.1f} GB/s in the same process). Medians of {repeats} calls.", "",
             *kernels.markdown(results)]
    if args.no_docs:
        print("\n".join(lines))
    else:
        publish(results, "docs/results/engine_kernels.json", "engine_kernels",
                "Engine: pdserve's kernels alone (issue 35)", "\n".join(lines))


if __name__ == "__main__":
    main()
