"""Tensor parallelism's scaling on this machine's cores: prefill and decode throughput at each TP size
a model allows, on the offline engine: SmolLM2 (9 heads, 3 KV heads: TP 1 and 3) and a random Llama
of the same size but 8 heads and 2 KV heads (TP 1, 2 and 4; built with transformers, random weights:
throughput does not depend on their values).

    python -m pdserve.benchmarks.tp_scaling [--prompt-len 1024] [--batch 8] [--output-len 64]

Prefill: one `--prompt-len`-token prompt, max_tokens 1 (prompt tokens per second). Decode: `--batch`
prompts of 32 tokens generating `--output-len` tokens each (output tokens per second). Each TP size
runs `--repeats` times and the best run counts; each rank takes its share of the cores (TP 3 on 2
cores: one thread per rank, three ranks on two cores).

Writes docs/results/tp_scaling.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from pdserve import LLM, SamplingParams
from pdserve.testing.random_models import save_random_model
from pdserve.benchmarks.report import publish
from pdserve.workload import random_prompts


def random_llama(path: str) -> str:
    """SmolLM2's shape (30 layers, hidden 512 here, MLP 1536) with 8 heads and 2 KV heads."""
    import transformers

    save_random_model(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2), path)
    return path


def measure(model: str | None, tp: int, args) -> dict:
    llm = LLM(model, dtype=args.dtype, quantization="none", tensor_parallel_size=tp, enable_prefix_caching=False)
    try:
        long, short = random_prompts(1, args.prompt_len, seed=1), random_prompts(args.batch, 32, seed=2)
        decode = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(short, SamplingParams(temperature=0, max_tokens=4))  # warm-up
        best = {"prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0}
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate(long, SamplingParams(temperature=0, max_tokens=1))
            best["prefill_tokens_per_s"] = max(best["prefill_tokens_per_s"], args.prompt_len / (time.perf_counter() - start))
            start = time.perf_counter()
            outs = llm.generate(short, decode)
            rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
            best["decode_tokens_per_s"] = max(best["decode_tokens_per_s"], rate)
        return {**best, "threads_per_rank": llm.engine.threads or "torch default", "dtype": str(llm.engine.plan.dtype)}
    finally:
        llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="docs/results/tp_scaling.json")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    res: dict = {"date": time.strftime("%Y-%m-%d"), "cores": cores, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, sizes in (("SmolLM2-135M (9 heads, 3 KV)", None, (1, 3)),
                                   ("random Llama (8 heads, 2 KV)", random_llama(tmp), (1, 2, 4))):
            res["models"][name] = {tp: measure(model, tp, args) for tp in sizes}
    lines = [f"Command: `python -m pdserve.benchmarks.tp_scaling` ({res['date']}; {cores} cores; {args.dtype}, "
             f"unquantized; best of {args.repeats}). Prefill: one {args.prompt_len}-token prompt; decode: "
             f"{args.batch} requests x {args.output_len} tokens.", "",
             "| model | TP | threads per rank | prefill tokens/s | vs TP 1 | decode tokens/s | vs TP 1 |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in res["models"].items():
        base = runs[1]
        for tp, r in runs.items():
            lines.append(f"| {name} | {tp} | {r['threads_per_rank']} | {r['prefill_tokens_per_s']:.0f} | "
                         f"{r['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}x | "
                         f"{r['decode_tokens_per_s']:.0f} | {r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x |")
    lines += ["", "TP splits a step's work over ranks that then all-reduce twice per layer (gloo, through the "
              "loopback). It pays where there are cores for every rank and a model large enough that its "
              "per-rank work outweighs those all-reduces; with more ranks than cores (TP 3 and 4 here) every "
              "all-reduce waits for a rank the OS has not scheduled, and with a 135M model the per-rank work is "
              "small: the figures show what TP costs here rather than what it gains."]
    publish(res, args.out, "tp_scaling", "Tensor parallelism's scaling (issue 18)", "\n".join(lines))


if __name__ == "__main__":
    main()
