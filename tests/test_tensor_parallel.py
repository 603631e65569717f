"""Tensor parallelism (models/parallel.py, engine/tp_workers.py): ranks as processes over gloo, each
with its slices of the model and the KV pool. Greedy float32 output equals TP 1's token for token:
SmolLM2 (9 heads, 3 KV heads) at TP 3, which splits both; a seeded random Llama (8 heads, 2 KV heads,
every bias) at TP 2 and TP 4, where each KV head is replicated on two ranks. A rank that dies makes
its node unhealthy and fails what it was doing; nothing hangs, and the ranks met on loopback, leaving
no file behind."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import httpx
import pytest
from servers import MODEL, NODE, start_pdserve

from pdserve import LLM, SamplingParams
from pdserve.procinfo import children

PROMPTS = ["The three primary colors are", "A list of prime numbers: 2, 3, 5, 7,",
           " ".join(f"Item {i}: the square of {i} is {i * i}." for i in range(40))]  # ~400 tokens: chunked
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def same_outputs(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert [r.logprob for r in x.logprobs] == pytest.approx([r.logprob for r in y.logprobs], abs=1e-3)


def test_smollm2_at_tp3_equals_tp1(llm_fp32):
    tp3 = LLM(None, dtype="float32", quantization="none", kv_cache_memory_gib=0.25, tensor_parallel_size=3,
              max_num_batched_tokens=256)
    try:
        assert tp3.engine.kv_spec.num_kv_heads == 1  # one of the 3 KV heads on each rank
        same_outputs(tp3.generate(PROMPTS, GREEDY), llm_fp32.generate(PROMPTS, GREEDY))
    finally:
        tp3.engine.close()


def test_a_random_llama_at_tp2_and_tp4_equals_tp1(random_llama):
    def run(tp: int):
        llm = LLM(random_llama, dtype="float32", num_kv_blocks=128, tensor_parallel_size=tp)
        try:
            return llm.engine.kv_spec.num_kv_heads, llm.generate(PROMPTS[:2], GREEDY)
        finally:
            llm.engine.close()

    heads1, tp1 = run(1)
    for tp in (2, 4):  # TP 4 > 2 KV heads: each rank holds one, every head on two ranks
        heads, out = run(tp)
        assert heads == 1 and heads1 == 2
        same_outputs(out, tp1)


def test_a_tp_size_that_does_not_split_the_model_is_refused():
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        LLM(None, dtype="float32", quantization="none", tensor_parallel_size=2)


def test_a_dead_rank_makes_the_node_unhealthy_and_nothing_hangs(tmp_path):
    temp_files = set(os.listdir(tempfile.gettempdir()))
    node = start_pdserve(["serve", "--tensor-parallel-size", "3", *NODE], tmp_path, "node")
    try:
        ask = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        assert httpx.post(node.url + "/v1/completions", json=ask, timeout=60).status_code == 200
        # The ranks' rendezvous (a TCP store) listens on loopback only, as the node's HTTP server does.
        listening = listening_addresses(node.proc.pid)
        assert len(listening) >= 2 and set(listening) <= LOOPBACK, listening
        ranks = [pid for pid in children(node.proc.pid) if "spawn_main" in cmdline(pid)]
        assert len(ranks) == 2, ranks  # ranks 1 and 2
        os.kill(ranks[-1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(node.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the node still says it is healthy"
            time.sleep(0.2)
        failed = httpx.post(node.url + "/v1/completions", json=ask, timeout=60)  # an error, not a hang
        assert failed.status_code >= 500, failed.text
    finally:
        node.stop()
    left = {name for name in set(os.listdir(tempfile.gettempdir())) - temp_files if name.startswith("pdserve")}
    assert not left, f"the node left {left} in the temp dir"


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net writes them


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets the process listens on, as /proc/net/tcp{,6} writes them."""
    fd_dir = f"/proc/{pid}/fd"
    inodes = set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1].split(":")[0])
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""
