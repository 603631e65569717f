"""lm-evaluation-harness against `pdserve up`, and against its own transformers backend on the
same weights: the scores must be equal.

    python -m pdserve.benchmarks.evalharness [--lm-eval PATH] [--mode pull|push|auto]

lm-eval is not a pdserve dependency (it brings datasets, evaluate, scikit-learn, ...): install it
in a virtual environment of its own, torch pinned to the CPU wheel, transformers to pdserve's:

    python3.11 -m venv .venv-eval
    .venv-eval/bin/pip install "lm-eval[hf,api]==0.4.13" torch==2.13.0 transformers==5.24.0

Two tasks whose data pdserve ships (benchmarks/lm_eval/, nothing is downloaded):
  pdserve_mc  32 multiple-choice questions scored by loglikelihood: lm-eval's `local-completions`
              model sends each context + choice as token ids with echo, logprobs and max_tokens 1,
              and reads the prompt's logprobs (through PD they come from the prefill node);
  pdserve_qa  16 questions answered by greedy generation: `local-chat-completions`, chat template.
pdserve runs float32 with its default decode quantization (int4 for the embedded Q4_1 GGUF; the
scoring path is dense, the file's own weights), as lm-eval's `hf` model loads the converted model
dir; the loglikelihoods must agree within 1e-3.

Writes docs/results/lm_eval.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.benchmarks.report import publish
from pdserve.platform import CpuInfo
from pdserve.models.locate import resolve_model_dir
from pdserve.procs import ProcessGroup, up_child

TASKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval"
SERVED_NAME = "SmolLM2-135M-Instruct"
TASKS = {  # task: (pdserve's lm-eval model, endpoint, metric, chat template)
    "pdserve_mc": ("local-completions", "/v1/completions", "acc,none", False),
    "pdserve_qa": ("local-chat-completions", "/v1/chat/completions", "exact_match,last_word", True),
}


def lm_eval(binary: str, model: str, model_args: str, task: str, chat: bool, out: Path) -> tuple[dict, list[dict]]:
    """One lm-eval run (offline: the tasks' data is local); its results and per-sample records."""
    args = [binary, "--model", model, "--model_args", model_args, "--tasks", task, "--include_path", ".",
            "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    if chat:
        args.append("--apply_chat_template")
    if model == "hf":
        args += ["--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run(args, cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"lm-eval {model} {task} failed:\n{proc.stderr[-3000:]}")
    results = json.loads(Path(sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]).read_text())
    samples_file = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))[-1]
    samples = [json.loads(line) for line in Path(samples_file).read_text().splitlines()]
    results["seconds"] = time.perf_counter() - started
    return results, samples


def compare(task: str, metric: str, ours: tuple[dict, list[dict]], theirs: tuple[dict, list[dict]]) -> dict:
    (r_ours, s_ours), (r_hf, s_hf) = ours, theirs
    by_doc = lambda samples: {s["doc_id"]: s for s in samples}  # noqa: E731
    a, b = by_doc(s_ours), by_doc(s_hf)
    name = metric.split(",")[0]
    differing = [d for d in a if a[d].get(name) != b.get(d, {}).get(name)]
    outputs_equal = all(a[d]["filtered_resps"] == b[d]["filtered_resps"] for d in a) if task == "pdserve_qa" else None
    gap = max((abs(x - y) for d in a for x, y in zip(loglikelihoods(a[d]), loglikelihoods(b[d]))), default=None)
    return {"pdserve": r_ours["results"][task][metric], "hf": r_hf["results"][task][metric],
            "samples": len(a), "samples_scored_differently": len(differing), "generations_equal": outputs_equal,
            "max_loglikelihood_difference": gap, "pdserve_seconds": r_ours["seconds"], "hf_seconds": r_hf["seconds"]}


def loglikelihoods(sample: dict) -> list[float]:
    """A loglikelihood sample's score of each choice (lm-eval logs [loglikelihood, is_greedy] per choice)."""
    if sample.get("filtered_resps") and isinstance(sample["filtered_resps"][0], (list, tuple)):
        return [float(resp[0]) for resp in sample["filtered_resps"]]
    return []


def markdown(res: dict, args) -> str:
    lines = [f"Command: `python -m pdserve.benchmarks.evalharness --mode {args.mode}` ({res['date']}; lm-eval "
             f"{res['lm_eval_version']}; pdserve up --mode {args.mode} --dtype float32 --quantization "
             f"{args.quantization} ({res['engine'].get('quantization')}); lm-eval's hf model on the GGUF's converted "
             "weights, float32; tasks and data in benchmarks/lm_eval/; CPU: "
             f"{res['cpu']}).", "",
             "| task | lm-eval model on pdserve | metric | pdserve | hf | samples | scored differently | "
             "largest loglikelihood difference | seconds (pdserve / hf) |", "|---|---|---|---|---|---|---|---|---|"]
    for task, c in res["tasks"].items():
        model, _, metric, _ = TASKS[task]
        gap = "" if c["max_loglikelihood_difference"] is None else f"{c['max_loglikelihood_difference']:.2e}"
        lines.append(f"| {task} | {model} | {metric} | {c['pdserve']:.4f} | {c['hf']:.4f} | {c['samples']} | "
                     f"{c['samples_scored_differently']} | {gap} | "
                     f"{c['pdserve_seconds']:.0f} / {c['hf_seconds']:.0f} |")
    qa = res["tasks"].get("pdserve_qa")
    if qa is not None:
        lines += ["", f"Generated answers identical to hf's, sample by sample: {'yes' if qa['generations_equal'] else 'no'}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval", default=shutil.which("lm_eval") or ".venv-eval/bin/lm_eval",
                        help="the lm_eval command of lm-eval's own virtual environment")
    parser.add_argument("--mode", default="pull", choices=["pull", "push", "colocated"],
                        help="how `pdserve up` serves (colocated: --colocated 1)")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="pdserve's decode quantization (auto: int4 for the embedded GGUF; scoring is dense)")
    parser.add_argument("--out", default="docs/results/lm_eval.json")
    args = parser.parse_args()
    binary = str(Path(args.lm_eval).resolve()) if Path(args.lm_eval).exists() else args.lm_eval
    if shutil.which(binary) is None:
        parser.error(f"--lm-eval {args.lm_eval}: not found (install lm-eval as this module's docstring says)")
    model_dir = str(resolve_model_dir(None))
    version = subprocess.run([str(Path(binary).with_name("python")), "-c", "import lm_eval; print(lm_eval.__version__)"],
                             capture_output=True, text=True).stdout.strip() or "?"
    up_args = ["--colocated", "1"] if args.mode == "colocated" else ["--mode", args.mode]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "lm_eval_version": version, "mode": args.mode,
                 "cpu": CpuInfo.detect().model, "tasks": {}}
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(stop_grace_s=30) as group:
        up = group.start(up_child((*up_args, "--dtype", "float32", "--quantization", args.quantization)))
        group.wait_ready([up], 300)
        res["engine"] = httpx.get(up.url + "/v1/nodes", timeout=10).json()["nodes"][0]["engine"]
        for task, (model, endpoint, metric, chat) in TASKS.items():
            served = f"model={SERVED_NAME},base_url={up.url}{endpoint},num_concurrent=1,max_retries=1"
            if model == "local-completions":
                served += f",tokenizer={model_dir},tokenized_requests=True"
            ours = lm_eval(binary, model, served, task, chat, Path(tmp) / f"{task}-pdserve")
            theirs = lm_eval(binary, "hf", f"pretrained={model_dir},dtype=float32", task, chat, Path(tmp) / f"{task}-hf")
            res["tasks"][task] = compare(task, metric, ours, theirs)
            print(task, res["tasks"][task], flush=True)
    publish(res, args.out, "lm_eval", "lm-evaluation-harness on pdserve vs its hf backend (issues 20, 32)", markdown(res, args))


if __name__ == "__main__":
    main()
