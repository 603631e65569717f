"""The "pdserve vs vLLM" table from the JSON files `benchmarks/peers/vllm_cpu.sh` writes.

    python -m pdserve.benchmarks.peers docs/results/peers --rates 0.5 1.0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdserve.benchmarks.report import update_section

SETUPS = (("pdserve-colocated", "pdserve, colocated x2"), ("vllm-colocated", "vLLM CPU 0.32.0, colocated x2"),
          ("pdserve-1p1d", "pdserve, 1P1D pull"), ("vllm-1p1d", "vLLM CPU 0.32.0, 1P1D NixlConnector"))


def markdown(folder: Path, rates: list[str]) -> str:
    lines = [
        f"Command: `bash benchmarks/peers/vllm_cpu.sh` (table written {time.strftime('%Y-%m-%d')}; each row's run "
        "date in its last column; before 2026-11-30 both bf16 (on another host), since then vLLM float32 on a CPU without "
        "bf16 arithmetic and pdserve's defaults; one core per "
        "instance; pdserve's proxy in front of both systems; `pdserve bench --dataset mixed` (90 % 128->128, "
        "10 % 2048->64), SLOs ttft:3000 tpot:80 ms).",
        "",
        "| setup | rate (req/s) | done | throughput (req/s) | output (tok/s) | TTFT p50 / p99 (ms) | "
        "TPOT p50 / p99 (ms) | SLO attainment | run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label in SETUPS:
        for rate in rates:
            path = folder / f"{key}-rate{rate}.json"
            if not path.exists():
                lines.append(f"| {label} | {rate} | not run | | | | | | |")
                continue
            r = json.loads(path.read_text())
            lines.append(
                f"| {label} | {rate} | {r['completed']}/{r['completed'] + r['failed']} | {r['request_throughput']:.2f} | "
                f"{r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | {r.get('slo_attainment', 0) * 100:.0f} % | "
                f"{r.get('date', '')[:10]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder")
    parser.add_argument("--rates", nargs="+", default=["0.5", "1.0"])
    args = parser.parse_args()
    text = markdown(Path(args.folder), args.rates)
    print(text)
    update_section(Path("docs/benchmarks.md"), "peers", "pdserve vs vLLM (CPU) on the mixed workload", text)


if __name__ == "__main__":
    main()
