"""simcheck's arithmetic: errors per metric, the targets, and the level an idle node sets."""

from __future__ import annotations

import pytest
from test_plan_simulator import known_profile

from pdserve.benchmarks.simcheck import errors, idle_level, within_targets

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
