"""PD disaggregation between nodes of different TP sizes, end to end: real P, D and proxy processes,
each TP node with its rank processes. Greedy float32 output through the proxy equals the single-node
TP 1 output, for pull and for layer-wise push, over tcp and over shm:
- SmolLM2 (3 KV heads): P TP 3 -> D TP 1 (D reads one head from each P rank) and P TP 1 -> D TP 3
  (each D rank reads its head from the one P rank);
- a random Llama (2 KV heads): P TP 2 -> D TP 4 (each D rank holds one head, replicated on two)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from servers import MODEL, NODE, Procs, metric

from pdserve import LLM, SamplingParams

PROMPTS = ["The three primary colors are", "A list of prime numbers: 2, 3, 5, 7,",
           " ".join(f"Item {i}: the square of {i} is {i * i}." for i in range(30))]  # ~300 tokens: several blocks
MAX_TOKENS = 16


def completions(url: str, model: str) -> list[str]:
    def ask(prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, PROMPTS))


def reference(llm: LLM) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.text for out in llm.generate(PROMPTS, params)]


def received(url: str) -> float:
    return metric(url, "pdserve:kv_transfer_bytes_total", 'direction="received"')


@pytest.fixture(scope="module")
def smollm_cluster(tmp_path_factory):
    """P TP 3 (pushes over tcp) and P TP 1 (shm); D TP 1 (pulls over tcp) and D TP 3 (shm); a proxy
    per direction and mode."""
    with Procs(tmp_path_factory.mktemp("tp-pd")) as procs:
        p3 = procs.start(["serve", "--role", "prefill", "-tp", "3", "--kv-transport", "tcp", *NODE], "p3")
        p1 = procs.start(["serve", "--role", "prefill", *NODE], "p1")
        d1 = procs.start(["serve", "--role", "decode", "--kv-transport", "tcp", *NODE], "d1")
        d3 = procs.start(["serve", "--role", "decode", "-tp", "3", *NODE], "d3")
        for name, p, d in (("3to1", p3, d1), ("1to3", p1, d3)):
            for mode in ("pull", "push"):
                procs.start(["proxy", "--mode", mode, "--prefill", p.url, "--decode", d.url], f"proxy-{mode}-{name}")
        yield procs


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair, decode", [("3to1", "d1"), ("1to3", "d3")])
def test_smollm2_between_tp_sizes_equals_one_node(smollm_cluster, llm_fp32, mode, pair, decode):
    before = received(smollm_cluster[decode].url)
    assert completions(smollm_cluster[f"proxy-{mode}-{pair}"].url, MODEL) == reference(llm_fp32)
    assert received(smollm_cluster[decode].url) > before  # the KV came from P, not recomputed


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_random_llama_from_tp2_to_tp4_equals_one_node(random_llama, tmp_path, mode):
    """2 KV heads: P rank r holds head r; D ranks 0, 1 hold head 0 and read it from P rank 0, D ranks
    2, 3 hold head 1 from P rank 1. Pull over shm, push over tcp."""
    node = ["--model", random_llama, "--served-model-name", "random-llama", "--dtype", "float32",
            "--kv-cache-memory", "0.05"]
    transport = ["--kv-transport", "tcp"] if mode == "push" else []
    with Procs(tmp_path) as procs:
        p2 = procs.start(["serve", "--role", "prefill", "-tp", "2", *transport, *node], "p2")
        d4 = procs.start(["serve", "--role", "decode", "-tp", "4", *node], "d4")
        proxy = procs.start(["proxy", "--mode", mode, "--prefill", p2.url, "--decode", d4.url], "proxy")
        got = completions(proxy.url, "random-llama")
        assert received(d4.url) > 0
    llm = LLM(random_llama, dtype="float32", kv_cache_memory_gib=0.05)
    try:
        assert got == reference(llm)
    finally:
        llm.engine.close()
