"""What `--batch-invariant` costs, on the default path (`--dtype auto`, `--quantization auto`) and
on float32 unquantized, in one run:

    python -m pdserve.benchmarks.batch_invariant [--repeats 3]

For each: a decode step at batch 1 and 32 (32-token prompts), and the prefill of one 512- and one
2048-token prompt, with and without the mode; best of --repeats each.

Writes docs/results/batch_invariant.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

from pdserve import LLM
from pdserve.benchmarks.report import publish
from pdserve.benchmarks.timing import decode_step_ms, prefill_ms
from pdserve.platform import CpuInfo

PATHS = {"default": {}, "float32": {"dtype": "float32", "quantization": "none"}}
BATCHES = (1, 32)
PROMPTS = (512, 2048)


def measure(options: dict, batch_invariant: bool, repeats: int) -> tuple[dict, dict[str, float]]:
    llm = LLM(enable_prefix_caching=False, batch_invariant=batch_invariant, kv_cache_memory_gib=0.5, **options)
    figures = {f"decode_step_ms_batch_{b}": decode_step_ms(llm, b, repeats) for b in BATCHES}
    figures |= {f"prefill_ms_{n}": prefill_ms(llm, n, repeats) for n in PROMPTS}
    labels = llm.engine.labels()
    llm.engine.close()
    return labels, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/results/batch_invariant.json")
    args = parser.parse_args()
    cpu = CpuInfo.detect()
    results = {"cpu": cpu.model, "isa": cpu.isa, "native_bf16": cpu.native_bf16, "paths": {}}
    rows = []
    for path, options in PATHS.items():
        labels, normal = measure(options, False, args.repeats)
        _, invariant = measure(options, True, args.repeats)
        results["paths"][path] = {"engine": labels, "normal": normal, "batch_invariant": invariant}
        for key in normal:
            rows.append(f"| {path} ({labels['dtype']}, {labels['quantization']}) | {key} | {normal[key]:.1f} | "
                        f"{invariant[key]:.1f} | {invariant[key] / normal[key]:.2f}x |")
    text = "\n".join([
        f"CPU: {cpu.model} ({cpu.isa}, native bf16: {cpu.native_bf16}), best of {args.repeats}:", "",
        "| path | figure | normal (ms) | --batch-invariant (ms) | cost |", "|---|---|---|---|---|", *rows, "",
        "Decode on the quantized kernels costs nothing more (they compute each row alone already); unquantized "
        "decode pads each GEMM to 16 rows; prefill pays for every query row attending alone over its own "
        "context on the decode kernel (growing with the prompt) and for the 16-row GEMM blocks. So the mode "
        "stays off by default: turn it on where equal answers across P + D, load and chunking matter more "
        "than prefill speed."])
    publish(results, args.out, "batch-invariant", "The cost of --batch-invariant (issue 32)", text)


if __name__ == "__main__":
    main()
