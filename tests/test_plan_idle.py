"""The profile's idle penalty (plan/idle.py): its fit, and its pairs measured on a real engine."""

from __future__ import annotations

import math
from typing import Callable

import pytest
from test_plan_simulator import known_profile

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.plan.idle import GAPS_S, NO_IDLE, fit_idle, measure_idle, penalty
from pdserve.plan.profile import Profile, describe


def pairs(excess_by_kind: dict[str, Callable[[float], float]], rounds: int = 3) -> list[dict]:
    """Samples as measure_idle records them, each cold step `excess(gap)` slower than its warm one."""
    return [{"kind": kind, "gap_s": gap, "warm_s": 0.1, "cold_s": 0.1 + excess(gap)}
            for _ in range(rounds) for kind, excess in excess_by_kind.items() for gap in GAPS_S]


def test_the_fit_recovers_a_known_penalty_and_a_host_without_one_pays_nothing():
    fit = fit_idle(pairs({"prefill": lambda g: 0.3 * -math.expm1(-g / 2.0),
                          "decode": lambda g: 0.15 * -math.expm1(-g / 2.0)}))
    assert fit["tau_s"] == pytest.approx(2.0, rel=0.08)  # the grid's step is 15 %
    assert fit["prefill_s"] == pytest.approx(0.3, rel=0.05) and fit["decode_s"] == pytest.approx(0.15, rel=0.05)
    assert penalty(fit, 1.0, True) == pytest.approx(0.3 * (1 - math.exp(-0.5)), rel=0.05)
    assert penalty(fit, 0.0, True) == 0.0 and penalty(fit, 1e9, False) == pytest.approx(fit["decode_s"])
    # Noise around zero (the cold step as often faster): nothing to pay, at any gap.
    flat = fit_idle(pairs({"prefill": lambda g: -0.002 if g < 1 else 0.001, "decode": lambda g: -0.001}))
    assert flat["decode_s"] == 0.0 and penalty(flat, 6.0, False) == 0.0
    assert flat["prefill_s"] < 0.002
    assert fit_idle([]) == NO_IDLE and penalty(NO_IDLE, 10.0, True) == 0.0


def test_measure_idle_pairs_a_warm_step_with_one_after_each_gap_on_the_real_engine(random_llama):
    engine = LLMEngine(EngineConfig(model=random_llama, dtype="float32", threads=1, kv_cache_memory_gib=0.05))
    try:
        samples = measure_idle(engine, seed=40, rounds=2, gaps=(0.01, 0.05))
        assert not engine.has_unfinished_requests()  # its decode request aborted, its blocks back
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    assert sorted((s["kind"], s["gap_s"]) for s in samples) == sorted(
        (k, g) for _ in range(2) for k in ("prefill", "decode") for g in (0.01, 0.05))
    assert all(s["warm_s"] > 0 and s["cold_s"] > 0 for s in samples)
    fit = fit_idle(samples)
    assert fit["tau_s"] > 0 and fit["prefill_s"] >= 0 and fit["decode_s"] >= 0


def test_a_profile_keeps_its_idle_samples_and_fit_and_says_what_they_cost(tmp_path):
    """Saved and loaded with its fit, described in ms at 0.3 / 1 / 3 s; a profile from before it
    was measured pays nothing."""
    samples = pairs({"prefill": lambda g: 0.2 * -math.expm1(-g), "decode": lambda g: 0.1 * -math.expm1(-g)})
    meta = {"model": "m", "cpu": "c", "isa": "i", "threads": 1, "engine": {}}
    profile = known_profile()
    profile.meta.update(meta)
    profile.samples["idle"], profile.idle = samples, {"tau_s": 1.0, "prefill_s": 0.2, "decode_s": 0.1}
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded.idle == profile.idle and loaded.samples["idle"] == samples
    assert "after it idled 0.3 / 1 / 3 s pays 52 / 126 / 190 ms more (prefill), 26 / 63 / 95 ms (decode): tau 1.0 s" \
        in describe(loaded)
    bare = known_profile()
    bare.meta.update(meta)
    bare.save(tmp_path / "old.json")
    assert Profile.load(tmp_path / "old.json").idle == NO_IDLE and "idled" not in describe(bare)
