"""`pdserve bench`: its pieces, and a real run against a real node."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from servers import metric, start_pdserve

from pdserve.platform import plan_kernels
from pdserve.workload import (
    BenchRequest,
    RequestResult,
    arrival_gaps,
    conversations,
    goodput_items,
    mixed_dataset,
    multiturn_dataset,
    parse_goodput,
    random_dataset,
    requests_from_args,
    summarize,
)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:3000"]) == {"ttft_ms": 500, "tpot_ms": 50, "e2el_ms": 3000}
    assert parse_goodput(["itl:200"]) == {"max_itl_ms": 200}
    assert goodput_items({"ttft_ms": 2343.4, "max_itl_ms": 67.0}) == ["ttft:2343.4", "itl:67.0"]  # its inverse
    for bad, message in (("ttft:abc", "not a number"), ("speed:5", "must be one of"), ("tpot:-1", "> 0")):
        with pytest.raises(ValueError, match=message):
            parse_goodput([bad])


def test_an_itl_slo_bounds_each_requests_longest_gap_which_a_tpot_slo_averages_away():
    """Two answers of 11 tokens at 20 ms a gap, one of them with a 1 s stall: TPOT 118 ms and 20 ms;
    with an ITL SLO of 200 ms the stalled one misses, with TPOT 150 ms both meet."""
    smooth = RequestResult(True, 100, 11, ttft_ms=100, e2el_ms=300, itls_ms=[20.0] * 10)
    stalled = RequestResult(True, 100, 11, ttft_ms=100, e2el_ms=1280, itls_ms=[20.0] * 9 + [1000.0])
    assert (smooth.max_itl_ms, stalled.max_itl_ms) == (20.0, 1000.0)
    assert stalled.tpot_ms == pytest.approx(118.0)
    assert summarize([smooth, stalled], 2.0, parse_goodput(["tpot:150"]))["slo_attainment"] == 1.0
    summary = summarize([smooth, stalled], 2.0, parse_goodput(["itl:200"]))
    assert summary["slo_attainment"] == 0.5
    assert summary["median_max_itl_ms"] == pytest.approx(510.0) and summary["p99_max_itl_ms"] > 990
    # Where the gaps are not kept (the planner's simulations), the longest is given instead.
    assert RequestResult(True, 100, 11, longest_gap_ms=750.0).max_itl_ms == 750.0


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


def test_multiturn_conversations_share_a_system_prompt_and_add_a_user_turn_each():
    requests = multiturn_dataset(3, seed=5, turns=4, system_len=32, user_len=8, answer_len=6, think_s=2.0)
    assert requests == multiturn_dataset(3, seed=5, turns=4, system_len=32, user_len=8, answer_len=6, think_s=2.0)
    sessions = conversations(requests)
    assert [len(turns) for turns in sessions] == [4, 4, 4]
    assert len({tuple(turns[0].prompt[:32]) for turns in sessions}) == 1  # one system prompt for all
    assert len({tuple(turns[0].prompt) for turns in sessions}) == 3  # different first user turns
    for turns in sessions:
        assert [len(t.prompt) for t in turns] == [40, 8, 8, 8]  # what each turn adds; the sender adds the history
        assert turns[0].think_s == 0 and all(t.think_s > 0 for t in turns[1:]) and all(t.output_len == 6 for t in turns)
    assert 1.0 < np.mean([t.think_s for t in requests if t.think_s]) < 4.0
    with_singles = [BenchRequest([1], 1, 1)] + requests[:2] + [BenchRequest([2], 1, 1)]
    assert [len(s) for s in conversations(with_singles)] == [1, 2, 1]


def dataset_flags(*argv: str):
    """`pdserve bench`'s parsed flags (only the dataset's are read)."""
    from pdserve.cli import build_parser

    return build_parser().parse_args(["bench", "--base-url", "http://127.0.0.1:1", *argv])


def test_named_workloads_have_their_stated_shapes_through_the_dataset_flag():
    summarize_ = requests_from_args(dataset_flags("--dataset", "summarize", "--num-prompts", "400", "--seed", "3"))
    assert summarize_ == requests_from_args(dataset_flags("--dataset", "summarize", "--num-prompts", "400", "--seed", "3"))
    assert all(1024 <= r.input_len <= 4096 and 32 <= r.output_len <= 128 for r in summarize_)
    assert min(r.input_len for r in summarize_) < 1400 and max(r.input_len for r in summarize_) > 3700  # spread out
    generate = requests_from_args(dataset_flags("--dataset", "generate", "--num-prompts", "400"))
    assert all(32 <= r.input_len <= 256 and 256 <= r.output_len <= 1024 for r in generate)
    assert np.mean([r.output_len for r in generate]) > 2 * np.mean([r.input_len for r in generate])  # decode-heavy
    assert requests_from_args(dataset_flags("--dataset", "chat", "--num-prompts", "50")) == mixed_dataset(50, seed=0)
    agentic = requests_from_args(dataset_flags("--dataset", "agentic", "--num-prompts", "3"))
    sessions = conversations(agentic)
    assert [len(turns) for turns in sessions] == [8, 8, 8]
    for turns in sessions:
        assert [t.input_len for t in turns] == [1536 + 256] + [256] * 7 and all(t.output_len == 64 for t in turns)
    assert agentic[0].prompt[:1536] == agentic[8].prompt[:1536]  # one system prompt (the tools) for all
    with pytest.raises(ValueError, match="neither one of random, mixed, chat, summarize"):
        requests_from_args(dataset_flags("--dataset", "summarise"))


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


def test_bench_multiturn_sends_each_conversations_turns_in_order_and_the_node_reuses_their_history(tmp_path):
    node = start_pdserve(["serve", "--kv-cache-memory", "0.1"], tmp_path, "multiturn_node")
    try:
        out = tmp_path / "r.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", node.url, "--dataset", "multiturn",
             "--num-prompts", "2", "--turns", "3", "--system-prompt-len", "64", "--turn-input-len", "16",
             "--turn-output-len", "4", "--think-time", "0.2", "--request-rate", "inf", "--out", str(out)],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads(out.read_text())
        assert result["completed"] == 6 and result["failed"] == 0
        starts, e2els = result["start_times"], result["e2els"]
        for c in range(2):  # a conversation's next turn starts after the last answer ended
            for k in range(c * 3, c * 3 + 2):
                assert starts[k + 1] >= starts[k] + e2els[k]
        lens = result["input_lens"]
        for c in range(2):  # each turn: the last prompt, its answer (4 tokens, retokenized) and 16 new tokens
            first, second, third = lens[c * 3: c * 3 + 3]
            assert first == 80 and 16 < second - first <= 16 + 8 and 16 < third - second <= 16 + 8
        computed = metric(node.url, "pdserve:prefill_tokens_computed")
        assert computed < sum(lens) - 4 * 80  # the system prompt and each conversation's history were reused
    finally:
        node.stop()
