"""simcheck's arithmetic: errors per metric, the targets, and the level an idle node sets."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import pytest
from test_plan_simulator import known_profile

from pdserve.benchmarks.host_load import against_profile, decode_counters
from pdserve.benchmarks.simcheck import (corun_note, errors, idle_level, idle_now, paired, paired_note, relay_now,
                                         within_targets)
from pdserve.plan.corun import decode_steps, timed_beside
from pdserve.procinfo import cpu_seconds, descendants

REAL = {"median_ttft_ms": 400.0, "p99_ttft_ms": 5000.0, "median_tpot_ms": 30.0, "p99_tpot_ms": 80.0,
        "request_throughput": 0.5, "slo_attainment": 0.8}


def test_errors_are_relative_and_attainment_in_points():
    sim = REAL | {"median_ttft_ms": 440.0, "p99_tpot_ms": 60.0, "slo_attainment": 0.65}
    err = errors(REAL, sim)
    assert err["median_ttft_ms"] == pytest.approx(0.10) and err["p99_tpot_ms"] == pytest.approx(-0.25)
    assert err["slo_attainment_points"] == pytest.approx(-15.0)
    assert not within_targets(err)  # 15 points off
    assert within_targets(errors(REAL, REAL | {"median_tpot_ms": 27.5, "p99_ttft_ms": 5900.0}))  # p99s within 20 %
    assert not within_targets(errors(REAL, REAL | {"p99_ttft_ms": 6100.0}))  # +22 %
    assert not within_targets(errors(REAL, REAL | {"request_throughput": 0.44}))  # -12 %


def test_paired_ratios_read_each_request_real_over_simulated_and_only_where_the_requests_pair():
    """Each request's TTFT and TPOT ratio, real over simulated. A mixture's median sits at the edge
    of its modes: one request of the fast mode run slow moves it +100 %, the requests' median ratio
    not at all."""
    fast, slow = [0.100] * 5, [0.200] * 4
    real = {"input_lens": [576] * 5 + [704] * 4, "output_lens": [11] * 9, "ttfts": fast + slow}
    sim = {**real, "ttfts": [0.099] * 5 + [0.198] * 4}
    real["e2els"] = [t + 10 * 0.020 for t in real["ttfts"]]  # TPOT 20 ms real, 25 simulated
    sim["e2els"] = [t + 10 * 0.025 for t in sim["ttfts"]]
    ratios = paired(real, sim)
    assert ratios["ttft_p50"] == pytest.approx(1.0101, abs=1e-3) and ratios["tpot_p50"] == pytest.approx(0.8)
    assert ratios["ttft_p10"] <= ratios["ttft_p50"] <= ratios["ttft_p90"]
    shifted = {**real, "ttfts": fast[:4] + [0.200] + slow}  # one request of the fast mode runs slow
    assert statistics.median(shifted["ttfts"]) == pytest.approx(0.200)  # the median jumps +100 %
    assert paired(shifted, real)["ttft_p50"] == pytest.approx(1.0)
    assert paired(real, {**sim, "input_lens": [576] * 5 + [800] * 4}) is None  # other prompts: no pairs
    assert paired(real, {**sim, "input_lens": sim["input_lens"][:8]}) is None
    retokenized = {**sim, "input_lens": [575] * 5 + [710] * 4}  # multiturn's real history, a few tokens off
    assert paired(real, retokenized)["ttft_p50"] == pytest.approx(ratios["ttft_p50"])
    assert paired({"ttfts": []}, sim) is None


def test_the_docs_note_lists_each_setups_paired_medians_and_nothing_for_older_runs():
    res = {"setups": {"a": {"paired": [{"ttft_p50": 1.0, "tpot_p50": 1.013}, None, {"ttft_p50": 0.97}]},
                      "c": {"errors": []}}}  # (c) recorded before paired was
    note = paired_note(res)
    assert note.endswith("(a) x1.00 / x1.01, -, x0.97.") and "(c)" not in note
    assert paired_note({"setups": {"c": {"paired": [None, None]}}}) == ""


def test_an_idle_node_sets_the_level_of_the_profiles_costs():
    profile = known_profile(budget=512)
    profile.serving = {"request_s": 0.01, "stream_s": 0.02, "step_s": 0.001}
    # Predicted: 2048 tokens in 4 chunks of 512 (10 ms + 1 ms/token each) + hop + stream + 4 steps'
    # serving cost; a lone decode step at 192 tokens: 20 + 5 + 1.92 ms + 1 ms serving.
    predicted_long = 4 * 0.010 + 2.048 + 0.01 + 0.02 + 4 * 0.001
    predicted_step = 0.020 + 0.005 + 192e-5 + 0.001
    level = idle_level(profile, {"ttft_long_ms": 1.5 * predicted_long * 1e3, "decode_step_ms": 0.8 * predicted_step * 1e3})
    assert level == pytest.approx({"prefill": 1.5, "decode": 0.8})
    scaled = profile.scaled(level)
    assert scaled.prefill_time(2048, 512) == pytest.approx(1.5 * profile.prefill_time(2048, 512))


def test_relay_factors_measured_beside_a_setup_replace_the_profiles():
    """relay_samples before and after a setup's runs: the median over all their rounds of each round's
    ratio of medians (relayed over idle); without samples, the profile's own factors."""
    profile = known_profile(budget=512)
    profile.corun = {**profile.corun, "relay": 1.3, "relay_decode": 1.2}
    assert relay_now(profile, []) == {"relay": 1.3, "relay_decode": 1.2}

    def one(prefill: tuple[float, float], step: tuple[float, float]) -> dict:
        return {"idle_prefill_ms": [prefill[0]] * 3, "relayed_prefill_ms": [prefill[1], prefill[1], 999.0],
                "idle_decode_step_ms": [step[0]] * 3, "relayed_decode_step_ms": [step[1]] * 3}

    before = {"rounds": [one((100, 110), (10, 10.5)), one((100, 130), (10, 11))]}
    after = {"rounds": [one((90, 108), (20, 20))]}
    # Prefill ratios 1.10, 1.30, 1.20 (each round's medians: one outlier does not count); steps 1.05, 1.10, 1.00.
    assert relay_now(profile, [before, after]) == pytest.approx({"relay": 1.2, "relay_decode": 1.05})
    # An older sample without decode steps keeps the profile's decode factor.
    prefill_only = {"rounds": [{k: v for k, v in one((100, 150), (1, 1)).items() if "prefill" in k}]}
    assert relay_now(profile, [prefill_only]) == pytest.approx({"relay": 1.5, "relay_decode": 1.2})


def test_the_idle_penalty_measured_beside_a_setup_replaces_the_profiles():
    """Pairs from before and after the setup's runs are pooled and fitted (plan/idle.py); a setup
    with none (an older recorded run, or --no-track-speed) keeps the profile's."""
    profile = replace(known_profile(), idle={"tau_s": 2.0, "prefill_s": 0.3, "decode_s": 0.1})
    assert idle_now(profile, []) == profile.idle

    def pairs(amplitude: float, tau: float) -> list[dict]:
        return [{"kind": kind, "gap_s": g, "warm_s": 0.1, "cold_s": 0.1 + a * -math.expm1(-g / tau)}
                for kind, a in (("prefill", amplitude), ("decode", amplitude / 2)) for g in (0.3, 1.0, 3.0)]

    now = idle_now(profile, [pairs(0.05, 1.0), pairs(0.05, 1.0)])
    assert now["tau_s"] == pytest.approx(1.0, rel=0.08) and now["prefill_s"] == pytest.approx(0.05, rel=0.05)
    assert now["decode_s"] == pytest.approx(0.025, rel=0.05)


def test_the_cost_note_lists_the_relay_and_idle_measured_beside_each_setup_merged_or_not():
    """A run recorded before `relay_tracked` says by its flag; a setup run again into it (--merge-into
    keeps the base's flag) says for itself; the idle penalty where a setup measured it."""
    profile = {"corun": {"prefill": 1.0, "decode": 1.0, "relay": 1.1, "relay_decode": 1.01}}
    old = {"relay": [{"rounds": []}], "relay_factors": {"relay": 1.08, "relay_decode": 1.03}}
    rerun = {"relay": [{"rounds": []}], "relay_factors": {"relay": 1.2, "relay_decode": 1.05}, "relay_tracked": True,
             "idle_samples": [[{}]], "idle_fit": {"tau_s": 1.0, "prefill_s": 0.2, "decode_s": 0.1}}
    merged = corun_note({"profile": profile, "setups": {"a": old, "b": rerun}})  # the base had no track_relay
    assert "(b) x1.20 / x1.05" in merged and "(a) x1.08" not in merged
    assert "(b) 126 / 63 ms" in merged  # 0.2 s and 0.1 s x (1 - e^-1)
    both = corun_note({"profile": profile, "setups": {"a": old, "b": rerun}, "track_relay": True})
    assert "(a) x1.08 / x1.03" in both and "(b) x1.20 / x1.05" in both


def test_a_nodes_decode_counters_count_its_decode_only_steps(fp32_node):
    """What simcheck reads of each node under load: an 8-token answer on an idle node is one
    prefill step (it samples the first token) and 7 decode-only steps of one sequence."""
    def read() -> dict[str, float]:
        return decode_counters(httpx.get(fp32_node.url + "/metrics", timeout=10).text)

    before = read()
    body = {"prompt": [1] * 20, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    httpx.post(fp32_node.url + "/v1/completions", json=body, timeout=60).raise_for_status()
    run = {k: v - before[k] for k, v in read().items()}
    assert run["decode_steps"] == 7 and run["decode_step_seqs"] == 7
    assert 7 * 20 < run["decode_step_kv_tokens"] <= 7 * 28  # the prompt and the tokens sampled so far
    assert run["decode_step_seconds"] > 0


def test_cpu_seconds_of_every_process_below_one():
    """A grandchild that computes for 0.5 s, then sleeps: found below its grandparent, and its CPU
    time read while it lives."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)"
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])"
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            below = descendants(parent.pid)
            if below and cpu_seconds(below[0]) >= 0.5:
                break
            time.sleep(0.1)
        assert len(below) == 1 and 0.5 <= cpu_seconds(below[0]) < 2.0
        assert cpu_seconds() > 0  # this process's own
    finally:
        for pid in descendants(parent.pid):
            subprocess.run(["kill", str(pid)])
        parent.wait(timeout=30)


def test_a_runs_load_read_against_the_profile():
    """Steps 10 % slower than the profile's at the node's mean batch, and CPU per streamed token."""
    profile = known_profile()
    step = profile.decode_step_time(4, 1000)
    load = {"wall_s": 10.0, "cpu_s": {"proxy": 1.0, "node": 12.0, "client": 0.5},
            "decode": {"http://n1": {"decode_steps": 100, "decode_step_seconds": 100 * 1.1 * step,
                                     "decode_step_seqs": 400, "decode_step_kv_tokens": 100_000},
                       "http://n2": dict.fromkeys(("decode_steps", "decode_step_seconds", "decode_step_seqs",
                                                   "decode_step_kv_tokens"), 0.0)}}
    reading = against_profile(load, profile, output_tokens=500)
    assert reading["decode_step_over_profile"] == [pytest.approx(1.1)]  # none for a node that never decoded
    assert reading["cpu_s_per_token"] == pytest.approx({"proxy": 0.002, "client": 0.001})
    assert reading["node_cpu_share"] == pytest.approx(0.6)


def test_pinned_prefill_times_a_nodes_engine_prefill_with_and_without_a_streaming_load(fp32_node):
    """plan/corun.py's timed_beside (the profile's relay factors; benchmarks/pinned_prefill.py): the
    node's own prefill times (ms, from its headers), and the load a client process streamed meanwhile."""
    quiet = timed_beside(fp32_node.url, 3, 7)
    assert len(quiet["ms"]) == 3 and all(ms > 0 for ms in quiet["ms"])
    assert quiet["p10_ms"] <= quiet["p50_ms"] <= quiet["p90_ms"] and quiet["load_tokens_per_s"] == 0
    loaded = timed_beside(fp32_node.url, 3, 8, fp32_node.url, set(os.sched_getaffinity(0)), 1)
    assert loaded["load_tokens_per_s"] > 0 and all(ms > 0 for ms in loaded["ms"])
    # Its decode steps: each answer's wait after the node's TTFT, a step a token after the first.
    steps = timed_beside(fp32_node.url, 2, 9, measure=decode_steps)
    assert len(steps["ms"]) == 2 and all(0 < ms < 1000 for ms in steps["ms"])
