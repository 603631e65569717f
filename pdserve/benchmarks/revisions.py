"""Before / after: the engine and KV transfer benchmarks on two revisions of pdserve, in one run.

    python -m pdserve.benchmarks.revisions --before 66c47e7 [--after HEAD] [--rounds 2]

Each revision is checked out into a temporary git worktree (removed on exit) and runs its own
benchmark modules from there; the revisions alternate round by round, so a drift of the machine
falls on both. Engine (`pdserve.benchmarks.engine`, pdserve only, one thread): the default path on
this CPU (dtype auto with the GGUF's int4) and float32 unquantized. Transfer
(`pdserve.benchmarks.transfer`): each backend's GB/s and the KV transfer inside TTFT on real P and
D nodes. For every figure: each revision's best over the rounds, after / before, and the noise (the
largest spread between one revision's own rounds), so "within noise" is measured, not assumed.
Writes docs/results/revisions.json and a section of docs/benchmarks.md.
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

from pdserve.benchmarks.report import publish
from pdserve.platform import CpuInfo, plan_kernels

# (figure, higher is better)
ENGINE_FIGURES = [("prefill_512_tok_s", True), ("decode_b1_tok_s", True), ("decode_b8_tok_s", True),
                  ("decode_b32_tok_s", True), ("offline_8x512_128_output_tok_s", True)]
TRANSFER_FIGURES = [("shm_contiguous_gbps", True), ("tcp_contiguous_gbps", True), ("shm_scattered_gbps", True),
                    ("tcp_scattered_gbps", True)]


def run(revision_dir: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    """A module of the revision checked out at `revision_dir`, run from there; its stdout."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(revision_dir)}
    proc = subprocess.run([sys.executable, "-m", *args], cwd=revision_dir, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} in {revision_dir} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def engine_figures(revision_dir: Path, dtype: str, quantization: str) -> dict[str, float]:
    out = run(revision_dir, ["pdserve.benchmarks.engine", "--only", "pdserve", "--dtypes", dtype,
                             "--quantizations", quantization, "--threads", "1"], {"OMP_NUM_THREADS": "1"})
    result = json.loads(out.strip().splitlines()[-1])
    return {name: result[name] for name, _ in ENGINE_FIGURES}


def transfer_figures(revision_dir: Path) -> dict[str, float]:
    out = revision_dir / "transfer.json"
    run(revision_dir, ["pdserve.benchmarks.transfer", "--out", str(out)])
    res = json.loads(out.read_text())
    figures = {name: res["backends"][name] for name, _ in TRANSFER_FIGURES}
    for key, row in res["ttft"].items():  # e.g. tcp_2048: TTFT and the transfer inside it, ms
        figures[f"ttft_{key}_ms"] = row["ttft_s"] * 1e3
        figures[f"kv_transfer_{key}_ms"] = row["transfer_s"] * 1e3
    return figures


def measure(revision_dir: Path, columns: list[tuple[str, str]]) -> dict[str, float]:
    figures = {}
    for dtype, quantization in columns:
        for name, value in engine_figures(revision_dir, dtype, quantization).items():
            figures[f"{dtype}+{quantization} {name}"] = value
    figures.update(transfer_figures(revision_dir))
    return figures


def higher_is_better(name: str) -> bool:
    return not name.endswith("_ms")


def compare(rounds: dict[str, list[dict[str, float]]], before: str, after: str) -> list[dict]:
    rows = []
    for name in rounds[before][0]:
        runs = {rev: [r[name] for r in rounds[rev]] for rev in (before, after)}
        pick = max if higher_is_better(name) else min
        best = {rev: pick(values) for rev, values in runs.items()}
        noise = max((max(v) - min(v)) / min(v) for v in runs.values())
        rows.append({"figure": name, "before": best[before], "after": best[after],
                     "after_over_before": best[after] / best[before], "noise": noise,
                     "within_noise": abs(best[after] / best[before] - 1) <= noise})
    return rows


def markdown(res: dict) -> str:
    lines = [f"Command: `python -m pdserve.benchmarks.revisions --before {res['before']} --after {res['after']} "
             f"--rounds {res['rounds']}` ({res['date']}; {res['cpu']}; engine columns pdserve only, 1 thread; "
             "best of the rounds; noise: the largest spread between one revision's own rounds).", "",
             "| figure | before | after | after / before | noise | within noise |", "|---|---|---|---|---|---|"]
    for row in res["rows"]:
        lines.append(f"| {row['figure']} | {row['before']:.2f} | {row['after']:.2f} | {row['after_over_before']:.3f} | "
                     f"{row['noise'] * 100:.1f} % | {'yes' if row['within_noise'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a git revision")
    parser.add_argument("--after", default="HEAD", help="a git revision")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="docs/results/revisions.json")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the noise is the spread between rounds)")
    plan = plan_kernels("auto")
    columns = [(plan.dtype, "int4"), ("float32", "none")]  # this CPU's default path, and float32
    revisions = {rev: subprocess.check_output(["git", "rev-parse", "--short", rev], text=True).strip()
                 for rev in (args.before, args.after)}
    with tempfile.TemporaryDirectory(prefix="pdserve-revisions-") as tmp:
        dirs = {}
        try:
            for rev, sha in revisions.items():
                dirs[sha] = Path(tmp) / sha
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(dirs[sha]), sha], check=True)
            rounds: dict[str, list[dict[str, float]]] = {sha: [] for sha in dirs}
            for i in range(args.rounds):
                for sha in (list(dirs) if i % 2 == 0 else list(dirs)[::-1]):
                    print(f"round {i + 1}: {sha} ...", file=sys.stderr, flush=True)
                    rounds[sha].append(measure(dirs[sha], columns))
        finally:
            for path in dirs.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], check=False)
    before, after = revisions[args.before], revisions[args.after]
    cpu = CpuInfo.detect()
    features = ", ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in cpu.flags)
    res = {"date": time.strftime("%Y-%m-%d"), "before": before, "after": after, "rounds": args.rounds,
           "cpu": f"{cpu.model} ({features}); {plan.describe()}", "columns": columns, "runs": rounds, "rows": compare(rounds, before, after)}
    publish(res, args.out, "revisions", "Before / after: engine and KV transfer on two revisions", markdown(res))


if __name__ == "__main__":
    main()
