"""Batch-1 decode and prefill against llama.cpp, on the same GGUF file, one core each:

    .venv/bin/python benchmarks/peers/llamacpp_peer.py [--llama-python ~/.cache/pdserve/llama-venv/bin/python] [--rounds 3]

llama.cpp is what CPU users pick for small models. Install its Python binding into its own venv
(PyPI carries only the source; cmake builds it, about 3.5 minutes on 2 cores). Its AMX kernels
(what -DGGML_NATIVE=ON picks on an AMX Xeon) crashed in the first decode on the 2-vCPU Xeon this was
written on, so they are left out; AVX-512 with VNNI and BF16 stay:

    python3.11 -m venv ~/.cache/pdserve/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
      -DGGML_OPENMP=OFF" ~/.cache/pdserve/llama-venv/bin/pip install llama-cpp-python==0.3.36
    (on an AVX2-only CPU: leave out the AVX512 flags)

llama.cpp runs the packaged Q4_1 file as it is (its own Q4_1 kernels, one thread); pdserve runs its
defaults (`--dtype auto --quantization auto`) on the same file. Both greedy, the same token prompts,
one request at a time, each in its own process pinned to one core; the systems alternate for
--rounds rounds and each figure is the median. Per case, as benchmarks/peers/vllm_offline.py counts
it: prefill tok/s = prompt tokens / time of a 1-token generate; decode tok/s = (output tokens - 1)
/ (time of the full generate - that prefill time). Writes docs/results/peers/llama_cpp.json and the
"peers_llama_cpp" section of docs/benchmarks.md. Not part of CI.
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

sys.path.insert(0, str(Path(__file__).parent))
from vllm_offline import child_pdserve, make_cases, medians, run_cases  # noqa: E402 (this folder's scripts share their timing)

CASES = [(1, 32, 128), (1, 512, 128), (1, 2048, 64)]  # requests x prompt tokens -> output tokens
SYSTEMS = ("llama.cpp", "pdserve defaults")


def child_llama(gguf: str, cases: list[dict]) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=4096, n_threads=1, n_threads_batch=1, n_batch=2048, verbose=False)

    def generate(prompts, n):
        for prompt in prompts:
            llm.reset()
            llm.eval(prompt)
            token = llm.sample(top_k=1, temp=0.0)  # the first token, from the prompt's logits
            for _ in range(n - 1):
                llm.eval([token])
                token = llm.sample(top_k=1, temp=0.0)

    return {"engine": {"system": "llama.cpp", "version": llama_cpp.__version__, "weights": "Q4_1 (the file's)",
                       "threads": 1}, "cases": run_cases(generate, cases)}


def run_child(system: str, python: str, source: str, cases_file: str, core: int) -> dict:
    result_file = Path(cases_file).with_suffix(f".{system.split()[0]}.result.json")
    cmd = ["taskset", "-c", str(core), python, __file__, "--child", system, "--source", source,
           "--cases", cases_file, "--result", str(result_file)]
    print(f"  running {system} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{system} failed:\n{proc.stderr[-4000:]}")
    return json.loads(result_file.read_text())


def markdown(results: dict) -> str:
    cols = results["columns"]
    llama, ours = cols["llama.cpp"]["cases"], cols["pdserve defaults"]["cases"]
    engine = cols["pdserve defaults"]["engine"]
    lines = [f"Command: `.venv/bin/python benchmarks/peers/llamacpp_peer.py --rounds {results['rounds']}` ({results['date']}, "
             f"{results['model']}, one core per system, {results['cpu']}; llama-cpp-python "
             f"{cols['llama.cpp']['engine']['version']}, the packaged Q4_1 GGUF as it is; pdserve "
             f"{engine.get('dtype')} + {engine.get('quantization')}). Same token prompts, greedy, one request at a "
             f"time; medians of {results['rounds']} alternating rounds.", "",
             "| case | llama.cpp prefill tok/s | llama.cpp decode tok/s | pdserve prefill tok/s | pdserve decode tok/s "
             "| decode pdserve / llama.cpp | prefill pdserve / llama.cpp |", "|---|---|---|---|---|---|---|"]
    for case in llama:
        a, b = llama[case], ours[case]
        lines.append(f"| {case} | {a['prefill_tok_s']:.0f} | {a['decode_tok_s']:.1f} | {b['prefill_tok_s']:.0f} | "
                     f"{b['decode_tok_s']:.1f} | {b['decode_tok_s'] / a['decode_tok_s']:.2f}x | "
                     f"{b['prefill_tok_s'] / a['prefill_tok_s']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", default=str(Path.home() / ".cache/pdserve/llama-venv/bin/python"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--out", default="docs/results/peers/llama_cpp.json")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)  # the GGUF (llama.cpp) or model directory (pdserve)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        cases = json.loads(Path(args.cases).read_text())
        result = (child_llama(args.source, cases) if args.child == "llama.cpp"
                  else child_pdserve(args.source, "auto", "auto", cases))
        Path(args.result).write_text(json.dumps(result))
        return

    from pdserve.benchmarks.report import publish
    from pdserve.models.locate import DEFAULT_MODEL, packaged_gguf_path, resolve_model_dir
    from pdserve.platform import CpuInfo

    if not Path(args.llama_python).exists():
        raise SystemExit(f"no llama.cpp at {args.llama_python}: install it as this script's docstring says, "
                         "or pass --llama-python")
    sources = {"llama.cpp": (args.llama_python, str(packaged_gguf_path(DEFAULT_MODEL))),
               "pdserve defaults": (sys.executable, str(resolve_model_dir(None)))}
    rounds: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    with tempfile.TemporaryDirectory() as tmp:
        cases_file = Path(tmp) / "cases.json"
        cases_file.write_text(json.dumps(make_cases(CASES)))
        for _ in range(args.rounds):  # alternating, so a drift of the host's speed falls on both
            for system in SYSTEMS:
                rounds[system].append(run_child(system, *sources[system], str(cases_file), args.core))
    cpu = CpuInfo.detect()
    flags = sorted(f for f in cpu.flags if f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"))
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": f"{cpu.model} ({', '.join(flags)})", "model": DEFAULT_MODEL,
               "rounds": args.rounds, "columns": {s: medians(r) for s, r in rounds.items()}, "raw": rounds}
    publish(results, args.out, "peers_llama_cpp", "pdserve vs llama.cpp, batch 1, one core each", markdown(results))


if __name__ == "__main__":
    main()
