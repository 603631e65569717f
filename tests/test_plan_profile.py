"""`pdserve profile`: the least-squares cost models, and a real quick profile of the embedded model."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transport import available
from pdserve.plan.corun import relay_factors, relay_samples
from pdserve.plan.fit import fit_linear
from pdserve.plan.idle import NO_IDLE
from pdserve.plan.measure import PROBE_TOKENS, pull_handoffs
from pdserve.plan.profile import NO_CORUN, Profile, corun_factors, decode_features, serving_overheads
from pdserve.plan.profile_cache import cached_profile_path, profile_for
from pdserve.platform import KERNELS_ENV
from pdserve.proxy.costs import CostModel

REPO = Path(__file__).resolve().parent.parent


def test_fit_recovers_a_known_linear_cost_and_reports_its_error():
    rows = [{"seqs": b, "kv_tokens": b * c} for b in (1, 2, 4, 8) for c in (100, 1000)]
    times = [0.02 + 0.001 * r["seqs"] + 2e-6 * r["kv_tokens"] for r in rows]
    fit = fit_linear(rows, times, ["one", "seqs", "kv_tokens"])
    assert fit.coefficients == pytest.approx([0.02, 0.001, 2e-6], rel=1e-6)
    assert fit.max_rel_error < 1e-9
    assert fit.predict({"seqs": 3, "kv_tokens": 3000}) == pytest.approx(0.02 + 0.003 + 0.006)
    noisy = [t * (1.1 if i % 2 else 0.9) for i, t in enumerate(times)]  # +-10 %: the error shows it (the fit absorbs some)
    assert 0.02 < fit_linear(rows, noisy, ["one", "seqs", "kv_tokens"]).mean_rel_error <= 0.10


def test_decode_fit_follows_each_measured_batch_size_where_a_line_cannot():
    """Per-sequence cost that falls at 32 sequences (as int4 decode does here): the hinges at the
    measured batch sizes pass through every one; one straight line in seqs misses them."""
    base = {1: 0.012, 2: 0.014, 4: 0.023, 8: 0.037, 16: 0.060, 32: 0.065}
    rows = [{"seqs": b, "kv_tokens": b * c} for b in base for c in (128, 512, 2048)]
    times = [base[r["seqs"]] + 3.7e-6 * r["kv_tokens"] for r in rows]
    features = decode_features([r["seqs"] for r in rows])
    assert features == ["one", "seqs", "kv_tokens", "seqs>2", "seqs>4", "seqs>8", "seqs>16"]
    fit = fit_linear(rows, times, features)
    assert fit.max_rel_error < 1e-9
    assert fit.predict({"seqs": 6, "kv_tokens": 0}) == pytest.approx((0.023 + 0.037) / 2)  # interpolated
    assert fit_linear(rows, times, ["one", "seqs", "kv_tokens"]).max_rel_error > 0.15
    costs = CostModel.of({"prefill_chunk": {"features": ["one", "tokens", "attention_pairs"], "coefficients": [0, 0, 0]},
                          "decode_step": asdict(fit), "transfer": {},
                          "meta": {"node": {"kv_bytes_per_token": 1, "max_num_batched_tokens": 512}}})
    for seqs, kv in ((1, 100), (6, 3000), (12, 5000), (32, 9000), (40, 9000)):
        assert costs.step_s(seqs, kv) == pytest.approx(fit.predict({"seqs": seqs, "kv_tokens": kv}))


def test_fit_refuses_too_few_samples_and_bad_times():
    with pytest.raises(ValueError, match="need at least 3 samples"):
        fit_linear([{"x": 1.0}], [1.0], ["one", "x", "y"])
    with pytest.raises(ValueError, match="must be > 0"):
        fit_linear([{"x": 1.0}, {"x": 2.0}], [1.0, 0.0], ["one", "x"])


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory, smollm_dir):
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--model", str(smollm_dir), "--quick",
                           "--threads", "1", "--quantization", "none", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_quick_profile_measures_every_cost_and_predicts_its_own_samples(quick_profile):
    out, stdout = quick_profile
    profile = Profile.load(out)
    assert "decode step" in stdout and "prefill chunk" in stdout and f"wrote {out}" in stdout
    assert profile.meta["quick"] is True and profile.meta["engine"]["quantization"] == "none"
    samples = profile.samples
    # Every planned point ran: 4 prompt lengths x 2 chunk sizes, decodes at 6 (batch, context) points.
    assert {(s["prompt_tokens"], s["chunk_size"]) for s in samples["prefill"]} == {
        (n, c) for n in (16, 128, 512, 1024) for c in (256, 1024)}
    assert {(s["seqs"], s["context"]) for s in samples["decode"]} == {(b, c) for b in (1, 4, 8) for c in (128, 1024)}
    assert profile.decode_step.features == ["one", "seqs", "kv_tokens", "seqs>4"]
    assert set(profile.transfer) == {s["transport"] for s in samples["transfer"]} == set(available())  # shm, tcp, ...
    assert profile.startup_s > 0
    # A chunk of 512 after 512 tokens costs more than one of 512 alone (attention).
    assert profile.prefill_chunk.predict({"tokens": 512, "attention_pairs": 512 * (512 + 256)}) > \
        profile.prefill_chunk.predict({"tokens": 512, "attention_pairs": 512 * 256})
    # Decode: more sequences and more context cost more; fits within 35 % of their own samples on average.
    assert profile.decode_step_time(8, 8 * 1024) > profile.decode_step_time(1, 1024)
    for fit in (profile.prefill_chunk, profile.decode_step):
        assert fit.mean_rel_error < 0.35, fit
    data = json.loads(out.read_text())
    assert set(data) == {"meta", "prefill_chunk", "decode_step", "transfer", "startup_s", "samples", "speed", "serving",
                         "corun", "idle"}
    assert profile.idle == NO_IDLE and "idle" not in samples  # full profiles only (plan/idle.py)
    # --quick leaves the co-run factors out (only `simulate --one-host` reads them), and says so.
    assert profile.corun == NO_CORUN and profile.meta["corun_measured"] is False
    assert "beside another busy core of this host: not measured (--quick" in stdout
    assert profile.speed["prefill_s"] > profile.speed["decode_s"] > 0  # a 512-token chunk against one decode step
    # What HTTP serving adds, from streamed probes: present, and a small share of a request's cost.
    assert len(samples["serving_probes"]) == 6 and all(p["ttft_s"] > 0 for p in samples["serving_probes"])
    assert 0 <= profile.serving["request_s"] < 1.0 and 0 <= profile.serving["step_s"] < 0.1
    # A hop is what the client waited beyond the node's engine's own TTFT (its x-pdserve-ttft-ms).
    probes = samples["serving_probes"]
    assert all(0 < p["engine_ttft_s"] < p["reply_s"] for p in probes)
    assert profile.serving["request_s"] == pytest.approx(statistics.median(p["reply_s"] - p["engine_ttft_s"]
                                                                           for p in probes))
    # Every streamed gap beyond its probe's median, sorted: the tail a long answer's longest gap draws from.
    excess = profile.serving["gap_excess_s"]
    assert len(excess) == 6 * (PROBE_TOKENS - 1) and excess == sorted(excess)
    assert excess[len(excess) // 2] == pytest.approx(0.0, abs=1e-3) and excess[-1] > 0
    assert "a streamed gap exceeds its stream's median by" in stdout


def test_refit_fits_the_recorded_samples_again_without_measuring(quick_profile, tmp_path):
    out, _ = quick_profile
    again = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--refit", str(out), "--out", str(again)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = Profile.load(out), Profile.load(again)
    assert after.decode_step.coefficients == pytest.approx(before.decode_step.coefficients, rel=1e-6)
    assert after.prefill_chunk.coefficients == pytest.approx(before.prefill_chunk.coefficients, rel=1e-6)
    assert (after.speed, after.corun, after.samples) == (before.speed, before.corun, before.samples)
    assert "refit" in after.meta and "refit" not in before.meta
    bare = json.loads(out.read_text())
    bare["samples"] = {}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--refit", str(tmp_path / "bare.json"),
                           "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "holds no samples to fit again" in proc.stderr


def test_corun_factors_time_this_engine_beside_a_twin_computing_on_the_other_core(random_llama, quick_profile,
                                                                                    tmp_path):
    """The full profile's co-run factors, on a small model: speed_index alone on one core, then with a
    twin engine busy on the other; about 1 where the cores do not slow each other, never far below.
    A --quick profile has none, and `simulate --one-host` on it says that it assumes none."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no other core to run the twin on")
    config = EngineConfig(model=random_llama, dtype="float32", threads=1, kv_cache_memory_gib=0.05)
    engine = LLMEngine(config)
    try:
        factors = corun_factors(engine, config, seed=3000)
    finally:
        engine.close()
    assert set(factors) == {"prefill", "decode"} and all(0.8 < f < 5.0 for f in factors.values()), factors
    out, _ = quick_profile
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "simulate", "--profile", str(out), "--setup",
                           "colocated:2", "--one-host", "--num-prompts", "4", "--request-rate", "1", "--out",
                           str(tmp_path / "sim.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "did not measure the co-run factors" in proc.stderr


def test_relay_samples_time_a_pinned_prefill_while_the_hosts_proxy_relays_streams(random_llama):
    """The full profile's relay measurement, on a small model: two served nodes pinned one to each
    core and a proxy in front of the second; the proxy's hop on top of the node's, and in each round
    the first node's prefills and decode steps with the second idle and then streaming through the proxy."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: no other core to stream from")
    samples = relay_samples(["--model", random_llama, "--dtype", "float32", "--threads", "1"], (cores[0], cores[1]),
                            prompts=3, streams=1, decodes=2, rounds=2)
    assert len(samples["direct_hop_ms"]) == len(samples["proxy_hop_ms"]) == 3 and len(samples["rounds"]) == 2
    for measured in samples["rounds"]:  # each round: A idle beside B, then beside B's relayed streams
        assert all(len(measured[k]) == 3 for k in ("idle_prefill_ms", "relayed_prefill_ms"))
        assert len(measured["idle_decode_step_ms"]) == len(measured["relayed_decode_step_ms"]) == 2
        timed = ("idle_prefill_ms", "relayed_prefill_ms", "idle_decode_step_ms", "relayed_decode_step_ms")
        assert all(x > 0 for k in timed for x in measured[k])
        assert measured["relayed_tokens_per_s"] > 0  # the streams ran while A prefilled
    assert all(x > 0 for x in samples["direct_hop_ms"])
    # The proxy's hop adds its own work (two more HTTP legs) to the node's.
    assert statistics.median(samples["proxy_hop_ms"]) > statistics.median(samples["direct_hop_ms"]) > 0
    factors = relay_factors(samples)
    assert factors.keys() == {"relay", "relay_decode"} and all(0.5 < f < 5.0 for f in factors.values())


def test_relay_factors_are_the_median_rounds_ratio_and_read_profiles_of_one_round():
    def round_of(idle: float, relayed: float) -> dict:
        return {"idle_prefill_ms": [idle, idle + 2, idle - 2], "relayed_prefill_ms": [relayed] * 3,
                "idle_decode_step_ms": [idle / 10], "relayed_decode_step_ms": [relayed / 10]}

    samples = {"rounds": [round_of(100, 110), round_of(100, 150), round_of(50, 60)]}  # x1.1, x1.5, x1.2
    assert relay_factors(samples) == pytest.approx({"relay": 1.2, "relay_decode": 1.2})
    before_rounds = {"idle_prefill_ms": [100, 80, 120], "relayed_prefill_ms": [130]}  # a profile of session 47
    assert relay_factors(before_rounds) == pytest.approx({"relay": 1.3})


def test_pull_handoffs_time_a_served_pull_pairs_kv_wait_and_the_profile_keeps_what_exceeds_the_transfer(
        random_llama, quick_profile):
    """A real pull pair on a small model, P pinned to one core and D to the other: D's wait for each
    prompt's KV, its bytes and transport; the profile's pull_handoff_s is that wait beyond the
    transport's fitted transfer of those bytes (median), never below zero."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: a pull pair needs a core each")
    handoffs = pull_handoffs(["--model", random_llama, "--dtype", "float32", "--threads", "1"], (cores[0], cores[1]),
                             prompts=3)
    assert len(handoffs) == 3
    assert len({h["kv_bytes"] for h in handoffs}) == 1 and handoffs[0]["kv_bytes"] > 0  # same-length prompts
    assert all(h["kv_load_s"] > 0 and h["transport"] in available() for h in handoffs)
    profile = Profile.load(quick_profile[0])
    waits = [h["kv_load_s"] - profile.transfer_time(h["transport"], h["kv_bytes"]) for h in handoffs]
    served = serving_overheads(profile, profile.samples["serving_probes"], handoffs=handoffs)
    assert served["pull_handoff_s"] == pytest.approx(max(statistics.median(waits), 0.0))
    assert serving_overheads(profile, profile.samples["serving_probes"])["pull_handoff_s"] == 0.0


def test_profile_cli_names_a_bad_argument():
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--quick", "--out", "/no/such/dir/p.json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "directory /no/such/dir does not exist" in proc.stderr


def test_each_machine_model_and_setting_has_its_own_cached_profile(tmp_path, monkeypatch, smollm_dir):
    """Auto mode's cache (plan/profile_cache.py): one file per machine, model and cost-bearing setting."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    base = EngineConfig(model=str(smollm_dir), threads=1)
    path = cached_profile_path(base)
    assert path == cached_profile_path(EngineConfig(model=str(smollm_dir), threads=1))
    assert path.parent == tmp_path / "profiles" and path.name.startswith(smollm_dir.name + "-")
    changes = ({"dtype": "bfloat16"}, {"quantization": "int8"}, {"max_num_batched_tokens": 512}, {"threads": 2},
               {"enable_chunked_prefill": False}, {"kv_cache_dtype": "bfloat16"})
    others = {cached_profile_path(replace(base, **change)) for change in changes}
    assert len(others) == len(changes) and path not in others
    # Where KV goes is not what computing it costs: a P node's settings share the file.
    assert cached_profile_path(replace(base, kv_transfer=KVTransferConfig(role="prefill"))) == path
    monkeypatch.setenv(KERNELS_ENV, "portable")
    assert cached_profile_path(base) != path
    monkeypatch.delenv(KERNELS_ENV)
    # A cached profile is used as it is, not measured again.
    path.parent.mkdir(parents=True)
    shutil.copy(REPO / "docs/results/profile.json", path)
    assert profile_for(base) == (path, False)
