"""What the API's extras cost per token: logprobs, prompt logprobs, the logit controls and structured
output, against the same requests without them, measured in one run on the offline engine.

    python -m pdserve.benchmarks.api_costs [--batch 8] [--output-len 128] [--prompt-len 512]

Decode: `--batch` prompts of 32 tokens generating `--output-len` tokens each (greedy, EOS
ignored), as output tokens per second. Structured output: a JSON schema the requests cannot complete
within --output-len (an array of at least 1000 short strings), so every request masks every token
and runs its full length. Prefill: one `--prompt-len`-token prompt, max_tokens 1, as
prompt tokens per second (prompt logprobs put the LM head over every prompt position, not just the
last). Each setting runs `--repeats` times, alternating, and the best run counts.

Writes docs/results/api_costs.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from pdserve import LLM, SamplingParams
from pdserve.benchmarks.report import publish
from pdserve.sampling_params import StructuredOutputs
from pdserve.workload import random_prompts

DECODE = {  # name: what the requests add to greedy decoding
    "plain": {},
    "logprobs 1": {"logprobs": 1},
    "logprobs 20": {"logprobs": 20},
    "penalties + logit_bias": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
                               "logit_bias": {100: 2.0, 200: -2.0}},
    "structured: JSON schema": {"structured": StructuredOutputs("json", {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000})},
}
PREFILL = {"plain": {}, "prompt logprobs 1": {"prompt_logprobs": 1}}


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Seconds for the batch, and the tokens it produced (output) or read (prompt)."""
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - started, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="docs/results/api_costs.json")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)  # every prefill computed in full
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    short = random_prompts(args.batch, 32, seed=1)
    long = random_prompts(1, args.prompt_len, seed=2)
    llm.generate(short, replace(greedy, max_tokens=8))  # warm-up
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, extra in DECODE.items():
            seconds, tokens = timed(llm, short, replace(greedy, **extra))
            best[f"decode: {name}"] = max(best.get(f"decode: {name}", 0.0), tokens / seconds)
        for name, extra in PREFILL.items():
            seconds, _ = timed(llm, long, SamplingParams(temperature=0, max_tokens=1, **extra))
            best[f"prefill: {name}"] = max(best.get(f"prefill: {name}", 0.0), args.prompt_len / seconds)
    res = {"date": time.strftime("%Y-%m-%d"), "dtype": str(llm.engine.plan.dtype), "batch": args.batch,
           "output_len": args.output_len, "prompt_len": args.prompt_len, "tokens_per_s": best}
    lines = [f"Command: `python -m pdserve.benchmarks.api_costs` ({res['date']}, {res['dtype']}, this machine, "
             f"the engine's default threads; best of {args.repeats}). Decode: {args.batch} requests x "
             f"{args.output_len} tokens; prefill: one {args.prompt_len}-token prompt.", "",
             "| requests | tokens/s | cost per token vs plain | added time per token |", "|---|---|---|---|"]
    for key, rate in best.items():
        base = best["decode: plain" if key.startswith("decode") else "prefill: plain"]
        lines.append(f"| {key} | {rate:.1f} | {base / rate - 1:+.1%} | {(1 / rate - 1 / base) * 1e6:+.0f} us |")
    lines += ["", "Differences of a few percent are within this host's run-to-run noise (a negative cost is one). "
              "Prompt logprobs put the LM head (vocabulary x hidden) over every prompt position instead of the "
              "last one: that is their prefill cost. Structured output computes each request's mask "
              "(llguidance, on the engine thread) and applies it to its logits row every step: a cost per "
              "token that does not grow with the model, so its share shrinks as the forward pass grows "
              "(this model's is a few milliseconds per step)."]
    publish(res, args.out, "api_costs", "What logprobs, logit controls and structured output cost per token (issue 20)",
            "\n".join(lines))


if __name__ == "__main__":
    main()
