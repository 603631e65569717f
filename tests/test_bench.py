"""`pdserve bench`: its pieces, and a real run against a real node."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from servers import start_pdserve

from pdserve.platform import plan_kernels
from pdserve.workload import (
    RequestResult,
    arrival_gaps,
    mixed_dataset,
    parse_goodput,
    random_dataset,
    summarize,
)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:3000"]) == {"ttft_ms": 500, "tpot_ms": 50, "e2el_ms": 3000}
    for bad, message in (("ttft:abc", "not a number"), ("speed:5", "must be one of"), ("tpot:-1", "> 0")):
        with pytest.raises(ValueError, match=message):
            parse_goodput([bad])


def test_arrivals_are_seeded_poisson_with_the_asked_rate():
    gaps = arrival_gaps(20_000, rate=4.0, burstiness=1.0, seed=3)
    assert gaps == arrival_gaps(20_000, rate=4.0, burstiness=1.0, seed=3)
    assert abs(np.mean(gaps) - 0.25) < 0.01
    assert abs(np.std(gaps) - 0.25) < 0.02  # exponential: std = mean
    bursty = arrival_gaps(20_000, rate=4.0, burstiness=0.25, seed=3)
    assert abs(np.mean(bursty) - 0.25) < 0.02 and np.std(bursty) > 0.4  # same rate, burstier
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_datasets_are_seeded_with_the_asked_shapes():
    mixed = mixed_dataset(1000, seed=1)
    assert mixed == mixed_dataset(1000, seed=1)
    long = [r for r in mixed if r.input_len == 2048]
    assert 60 < len(long) < 140 and all(r.output_len == 64 for r in long)
    assert all(r.input_len == len(r.prompt) for r in mixed)
    rnd = random_dataset(200, 100, 20, 0.5, seed=2)
    assert all(50 <= r.input_len <= 150 and 10 <= r.output_len <= 30 for r in rnd)


def test_summary_uses_vllm_definitions():
    ok = RequestResult(True, input_len=10, output_len=5, ttft_ms=100, e2el_ms=500, itls_ms=[100] * 4)
    slow = RequestResult(True, input_len=10, output_len=5, ttft_ms=900, e2el_ms=1300, itls_ms=[100] * 4)
    failed = RequestResult(False, input_len=10, error="HTTP 503")
    s = summarize([ok, slow, failed], duration=2.0, slos={"ttft_ms": 500})
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["mean_tpot_ms"] == 100  # (500 - 100) / (5 - 1)
    assert s["mean_ttft_ms"] == 500 and s["total_output_tokens"] == 10
    assert s["request_goodput"] == 0.5 and s["slo_attainment"] == pytest.approx(1 / 3)


def test_bench_against_a_real_node(tmp_path):
    node = start_pdserve(["serve", "--kv-cache-memory", "0.1"], tmp_path, "bench_node")
    try:
        out, png = tmp_path / "r.json", tmp_path / "r.png"
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", node.url, "--dataset", "random",
             "--input-len", "24", "--output-len", "6", "--num-prompts", "5", "--request-rate", "20",
             "--goodput", "ttft:60000", "tpot:60000", "--out", str(out), "--plot", str(png)],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads(out.read_text())
        assert result["completed"] == 5 and result["failed"] == 0
        assert result["total_input_tokens"] == 5 * 24 and result["total_output_tokens"] == 5 * 6
        assert result["slo_attainment"] == 1.0 and result["request_goodput"] > 0
        for key in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms", "request_throughput"):
            assert result[key] > 0
        assert png.read_bytes()[:4] == b"\x89PNG"
        assert "Mean TTFT (ms)" in proc.stdout
        # What the node ran on, as its engine_info says (the default dtype: this CPU's choice).
        plan = plan_kernels("auto")
        [engine] = result["engines"]
        assert engine["url"] == node.url
        assert (engine["dtype"], engine["kernels"], engine["isa"]) == (plan.dtype, plan.kernels, plan.isa)
        assert f"{plan.dtype}, {plan.kernels} kernels, {plan.isa}" in proc.stdout
    finally:
        node.stop()
