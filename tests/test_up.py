"""`pdserve up` as a new user meets it: with no flags on an AVX2-only CPU, and with a node that dies
while starting (one line naming the error, the others stopped, a non-zero exit at once)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import free_port

from pdserve.cli import build_parser
from pdserve.launcher import node_command, one_thread, plan_cores
from pdserve.models.native import kernels_root
from pdserve.plan.profile import Profile
from pdserve.plan.shape import shape_for
from pdserve.platform import AVX2_EMULATION, KERNELS_ENV
from pdserve.procinfo import alive
from pdserve.procs import ProcessGroup, up_child

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


SIXTH_PROFILE = Path(__file__).resolve().parent.parent / "docs/results/winmap_first_token_profile.json"


def nodes_with_engine_info(url: str) -> list[dict]:
    """The proxy's /v1/nodes once its health poll has read every node's engine_info."""
    deadline = time.monotonic() + 10
    nodes = httpx.get(url + "/v1/nodes").json()["nodes"]
    while not all(node["engine"] for node in nodes):
        assert time.monotonic() < deadline, nodes
        time.sleep(0.2)
        nodes = httpx.get(url + "/v1/nodes").json()["nodes"]
    return nodes


def test_up_with_no_flags_on_an_avx2_only_cpu_answers_the_readme_curl(tmp_path):
    env = {**os.environ, **AVX2_EMULATION}
    env.pop(KERNELS_ENV, None)
    up = up_child(["--kv-cache-memory", "0.15"], log_path=str(tmp_path / "up.log"))
    up.start(env)
    url = up.url
    try:
        ProcessGroup().wait_ready([up], 180)
        answer = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        nodes = nodes_with_engine_info(url)
        for node in nodes:
            assert (node["engine"]["dtype"], node["engine"]["kernels"], node["engine"]["isa"]) == \
                ("float32", "portable", "AVX2"), node
    finally:
        assert up.stop(grace_s=30) == 0
    out = (tmp_path / "up.log").read_text()
    assert "(AVX2): float32 on portable kernels" in out
    assert "Traceback" not in out


def test_a_node_that_dies_while_starting_is_told_in_one_line(tmp_path, smollm_dir):
    """Weights that cannot be read: both nodes die with a traceback; up prints one line, stops the
    rest and exits non-zero."""
    model = tmp_path / "broken-model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, model / name)
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json and not tensors")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--port", str(free_port()), "--model", str(model)],
                         capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert run.returncode == 1, run.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s to give up"
    lines = [line for line in run.stderr.splitlines() if "while starting" in line]
    assert len(lines) == 1, run.stderr
    assert re.match(r"pdserve up: (prefill|decode)-\d exited with status 1 while starting: \S*Error", lines[0]), lines[0]
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout
    full = Path(re.search(r"full output: (\S+)\)", lines[0]).group(1))
    try:
        assert "Traceback" in full.read_text()
    finally:
        full.unlink()
    deadline = time.monotonic() + 10
    while processes_mentioning(str(model)):
        assert time.monotonic() < deadline, processes_mentioning(str(model))
        time.sleep(0.2)


def test_a_bad_kernel_setting_stops_up_before_any_node_starts(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--port", str(free_port())],
                         env={**os.environ, KERNELS_ENV: "fastest"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "pdserve: error: kernels (PDSERVE_KERNELS) must be one of auto, portable, got 'fastest'")
    assert "starting" not in run.stdout


def test_up_with_a_tp3_prefill_node_answers_the_readme_curl(tmp_path):
    """--prefill-tp 3: SmolLM2's P node runs 3 ranks, its D node 1; the answer is the one-node one."""
    up = up_child(["--kv-cache-memory", "0.15", "--dtype", "float32", "--prefill-tp", "3"],
                  log_path=str(tmp_path / "up.log"))
    up.start()
    try:
        ProcessGroup().wait_ready([up], 240)
        answer = httpx.post(up.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        nodes = nodes_with_engine_info(up.url)
        assert sorted((n["role"], n["engine"]["tensor_parallel_size"]) for n in nodes) == [
            ("decode", "1"), ("prefill", "3")]
    finally:
        assert up.stop(grace_s=30) == 0
    assert "1 prefill (TP 3) + 1 decode (TP 1)" in (tmp_path / "up.log").read_text()


def test_up_with_a_p_node_of_two_threads_answers_the_readme_curl(tmp_path):
    """--prefill-threads 2: the P node computes on 2 threads, the D node on 1 (pinned where the
    machine has 3 cores, else not); the answer is the README's."""
    up = up_child(["--kv-cache-memory", "0.15", "--prefill-threads", "2"], log_path=str(tmp_path / "up.log"))
    up.start()
    try:
        ProcessGroup().wait_ready([up], 240)
        answer = httpx.post(up.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
        nodes = nodes_with_engine_info(up.url)
        assert sorted((n["role"], n["engine"]["threads"]) for n in nodes) == [("decode", "1"), ("prefill", "2")]
    finally:
        assert up.stop(grace_s=30) == 0


def test_a_tp_size_that_cannot_split_the_model_stops_up_before_any_node_starts():
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--port", str(free_port()), "--decode-tp", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "pdserve: error: --decode-tp 2: tensor parallel size 2 does not divide the model's 9 attention heads")
    assert "starting" not in run.stdout


def test_per_role_settings_reach_only_their_role():
    up = build_parser().parse_args(["up", "--prefill-max-num-batched-tokens", "512", "--decode-max-num-seqs", "8"])
    p, d = node_command(up, None, "prefill"), node_command(up, None, "decode")
    assert p[p.index("--max-num-batched-tokens") + 1] == "512" and "--max-num-seqs" not in p
    assert d[d.index("--max-num-batched-tokens") + 1] == "2048" and d[d.index("--max-num-seqs") + 1] == "8"


def test_per_role_threads_reach_their_role_and_pin_as_many_cores():
    up = build_parser().parse_args(["up", "--prefill-threads", "2"])
    p, d = node_command(up, None, "prefill"), node_command(up, None, "decode")
    assert p[p.index("--threads") + 1] == "2" and "--threads" not in d
    # D runs one thread, pinned or not, once P's threads are set (node_command passes P's)
    assert one_thread(up, "decode", None) == ["--threads", "1"] and one_thread(up, "prefill", (0, 1)) == []
    plain = build_parser().parse_args(["up"])
    assert one_thread(plain, "decode", (1,)) == ["--threads", "1"] and one_thread(plain, "decode", None) == []
    assert plan_cores([2, 1], available=[0, 1, 2, 3]) == [(0, 1), (2,)]
    assert plan_cores([2, 1, 1], available=[4, 5, 6, 7]) == [(4, 5), (6,), (7,)]
    assert plan_cores([2, 1], available=[0, 1]) == [None, None]  # not enough cores: no pinning


@pytest.mark.parametrize("flags, error", [
    (["--ray-placement", "pack"], "--ray-placement pack places Ray actors: it needs --ray"),
    (["--placement", "pack"], "--ray-placement pack places Ray actors: it needs --ray"),  # issue 17's spelling
    (["--placement", "cost", "--placement", "threshold"], "--placement takes one rule, got ['cost', 'threshold']"),
    (["--no-chunked-prefill", "--max-prefill-tokens-while-decoding", "64"],
     "max_prefill_tokens_while_decoding must be >= 0 and needs chunked prefill, got 64 with chunked prefill off"),
    (["--max-prefill-tokens-while-decoding", "-1"],
     "max_prefill_tokens_while_decoding must be >= 0 and needs chunked prefill, got -1"),
    (["--rate", "0.5"], "--rate / --workload describe the load auto's shape is chosen for: they need "
                        "--mode auto --nodes N --slo ... (and --shape plan, the default)"),
    (["--mode", "auto", "--nodes", "2", "--slo", "itl:70", "--workload", "poems", "--profile", str(SIXTH_PROFILE)],
     "--workload 'poems': choose from mixed, chat, summarize, generate, multiturn, agentic"),
    (["--colocated", "2", "--decode-max-num-seqs", "4"],
     "--decode-max-num-seqs sets P and D nodes by role; --colocated 2 has none"),
    (["--prefill-max-num-batched-tokens", "0"], "--prefill-max-num-batched-tokens must be >= 1, got 0"),
    (["--colocated", "2", "--prefill-threads", "2"],
     "--prefill-threads sets P and D nodes by role; --colocated 2 has none"),
    (["--decode-threads", "0"], "--decode-threads must be >= 1, got 0"),
    (["--prefill-tp", "3", "--prefill-threads", "2"],
     "--prefill-threads sets a one-process node's threads; a TP node's ranks share the cores (--prefill-tp 3)"),
    (["--mode", "auto", "--decode-threads", "2", "--profile", str(SIXTH_PROFILE)],
     "--decode-threads: auto mode prices every node with one profile of one thread; use it with --mode pull or push"),
    (["--mode", "auto", "--nodes", "2", "--slo", "itl:70", "--rate", "-1", "--profile", str(SIXTH_PROFILE)],
     "--rate -1: expected a finite number of requests per second > 0"),
])
def test_placement_and_batching_flags_that_cannot_hold_stop_up_before_any_node_starts(flags, error):
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--port", str(free_port()), *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"pdserve: error: {error}"
    assert "starting" not in run.stdout


def test_up_auto_without_a_profile_measures_one_then_starts_from_the_cached_one(tmp_path, smollm_dir):
    """`pdserve up --mode auto` with no --profile: the first start measures a quick profile for this
    machine, model and node settings and caches it; the second finds it. Both say which, both serve."""
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    # A fresh cache for the profiles, but this machine's compiled kernels: building them again took 80 s.
    kernels = kernels_root()
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    flags = ["--mode", "auto", "--nodes", "1", "--model", str(smollm_dir), "--kv-cache-memory", "0.15",
             "--dtype", "float32", "--quantization", "none"]
    for start, words in ((1, "measuring a quick one"), (2, "using the one cached")):
        up = up_child(flags, log_path=str(tmp_path / f"up{start}.log"))
        up.start(env)
        try:
            ProcessGroup().wait_ready([up], 420)
            answer = httpx.post(up.url + "/v1/chat/completions", json=CHAT, timeout=120)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
            assert answer.headers["x-pdserve-placement"] == "local"  # priced, so placed by auto mode
        finally:
            assert up.stop(grace_s=30) == 0
        log = (tmp_path / f"up{start}.log").read_text()
        assert "auto mode: no --profile given" in log and words in log, log[-3000:]
        [cached] = (tmp_path / "cache" / "profiles").glob("*.json")
        assert str(cached) in log
        profile = json.loads(cached.read_text())
        assert profile["meta"]["quick"] is True and profile["meta"]["threads"] == 1  # as each pinned node runs
        assert profile["meta"]["engine"]["quantization"] == "none"


def test_auto_makes_prefill_and_decode_take_turns_where_the_itl_slo_fits_no_chunk_beside_a_decode_step(caplog):
    """At ITL 100 ms this profile's decode step of 8 streams (129 ms) misses the SLO alone: any step
    that prefilled beside streams would miss it, so each node's prompts wait until its streams have
    finished (a cap of 0), and the log says why."""
    import argparse
    import logging

    from pdserve.cli import itl_prefill_cap

    profile = Path(__file__).resolve().parent.parent / "docs/results/profile.json"
    args = argparse.Namespace(slo=["ttft:5000", "itl:100"], no_chunked_prefill=False, profile=str(profile),
                              max_prefill_tokens_while_decoding=None)
    with caplog.at_level(logging.INFO, logger="pdserve"):
        itl_prefill_cap(args)
    assert args.max_prefill_tokens_while_decoding == 0
    assert "every node's prefill and decode take turns" in caplog.text
    args.slo, args.max_prefill_tokens_while_decoding = ["itl:1000"], None
    itl_prefill_cap(args)
    assert args.max_prefill_tokens_while_decoding == 192


def test_up_auto_under_an_itl_slo_caps_each_nodes_prefill_while_decoding(tmp_path, smollm_dir):
    """--slo itl:1000 in auto mode over kv_both nodes it was given (--shape kv_both: no shape picked,
    which would bring its own): every node gets the prefill cap the profile says keeps a step within
    it (the planner's prefill_cap_for), says so, and reports it in its engine info."""
    from pdserve.plan.planner import prefill_cap_for
    from pdserve.plan.profile import Profile

    profile = Path(__file__).resolve().parent.parent / "docs/results/profile.json"
    cap = prefill_cap_for(Profile.load(profile), 1.0)
    assert cap > 16  # a cap this profile fits beside a decode step
    up = up_child(["--mode", "auto", "--nodes", "1", "--shape", "kv_both", "--model", str(smollm_dir),
                   "--kv-cache-memory", "0.15", "--profile", str(profile), "--slo", "ttft:60000", "itl:1000"],
                  log_path=str(tmp_path / "up.log"))
    up.start()
    try:
        ProcessGroup().wait_ready([up], 180)
        nodes = nodes_with_engine_info(up.url)
        assert [n["engine"]["max_prefill_tokens_while_decoding"] for n in nodes] == [str(cap)]
    finally:
        assert up.stop(grace_s=30) == 0
    assert f"every node computes at most {cap} prompt tokens a step while streams decode" in \
        (tmp_path / "up.log").read_text()


def test_up_auto_under_an_itl_slo_runs_as_the_shape_the_simulator_picks(tmp_path, smollm_dir):
    """`up --mode auto --nodes 2 --slo itl:69` on the sixth look's profile: the simulator finds two
    colocated nodes whose prefill and decode take turns best for chat under that SLO (as the ninth
    look measured), so auto starts two kv_both nodes with a prefill cap of 0, says so, and places
    requests over them; greedy answers match."""
    up = up_child(["--mode", "auto", "--nodes", "2", "--model", str(smollm_dir), "--kv-cache-memory", "0.15",
                   "--profile", str(SIXTH_PROFILE), "--slo", "itl:69"], log_path=str(tmp_path / "up.log"))
    pick = shape_for(Profile.load(SIXTH_PROFILE), "chat", {"max_itl_ms": 69.0}, 2)
    assert pick.setup == "colocated:2 (--max-prefill-tokens-while-decoding 0)"
    up.start()
    try:
        ProcessGroup().wait_ready([up], 180)
        nodes = nodes_with_engine_info(up.url)
        assert sorted(n["role"] for n in nodes) == ["kv_both", "kv_both"]
        assert all(n["engine"]["max_prefill_tokens_while_decoding"] == "0" for n in nodes)
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        answers = [httpx.post(up.url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
        assert all(a.status_code == 200 for a in answers), answers[0].text
        assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]
        assert "Paris" in answers[0].json()["choices"][0]["text"]
    finally:
        assert up.stop(grace_s=30) == 0
    log = (tmp_path / "up.log").read_text()
    assert "auto mode, 2 nodes, workload chat: runs as colocated:2 (--max-prefill-tokens-while-decoding 0)" in log, \
        log[-3000:]
