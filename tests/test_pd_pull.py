"""PD disaggregation with pull, end to end: real P, D, colocated node and proxy processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time

import httpx
import openai
import pytest
from servers import MODEL, NODE, Procs, free_port, metric, start_pdserve, wait_for_metric

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.messages import RequestOutput
from pdserve.engine.threaded_client import ThreadedEngineClient
from pdserve.kv.params import parse as parse_kv_transfer_params
from pdserve.procinfo import alive, children
from pdserve.procs import ProcessGroup, up_child
from pdserve.sampling_params import SamplingParams


def long_text() -> str:
    return " ".join(f"Paragraph {i}: the quick brown fox number {i} jumps over lazy dog {i * 7}." for i in range(70))


PROMPTS = [
    "The history of the Roman Empire",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef softmax(x):",
    "The three primary colors are",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Photosynthesis converts light energy into chemical energy. The process begins when",
    "Q: What is the boiling point of water?\nA:",
    long_text() + "\nSummary:",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("pd")) as procs:
        procs.start(["serve", "--role", "both", *NODE], "both")
        p = procs.start(["serve", "--role", "prefill", *NODE], "p")
        d_shm = procs.start(["serve", "--role", "decode", "--kv-transport", "shm", *NODE], "d_shm")
        d_tcp = procs.start(["serve", "--role", "decode", "--kv-transport", "tcp", *NODE], "d_tcp")
        procs.start(["proxy", "--prefill", p.url, "--decode", d_shm.url, d_tcp.url], "proxy")
        yield procs


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_greedy_outputs_through_proxy_equal_colocated_node(cluster):
    reference = client(cluster["both"].url)
    expected = [
        reference.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0) for p in PROMPTS
    ]
    assert expected[-1].usage.prompt_tokens > 1000
    proxy = client(cluster["proxy"].url)

    def ask(i: int):
        if i % 2:
            chunks = list(proxy.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
        out = proxy.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0)
        return out.choices[0].text, out.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    assert got == [(e.choices[0].text, e.usage.completion_tokens) for e in expected]

    # Both transports carried KV (the proxy alternates between the shm and the tcp decoder).
    for d in ("d_shm", "d_tcp"):
        assert metric(cluster[d].url, "pdserve:kv_transfer_bytes_total", 'direction="received"') > 0
    assert metric(cluster["p"].url, "pdserve:kv_transfer_bytes_total", 'direction="sent"') > 0  # tcp bytes


def test_chat_through_proxy(cluster):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client(cluster["proxy"].url).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    assert out.choices[0].message.content == "The capital of France is Paris."


def test_decode_nodes_never_prefill_and_blocks_return_to_zero(cluster):
    proxy = client(cluster["proxy"].url)
    before = {d: (metric(cluster[d].url, "pdserve:prefill_tokens_computed_total"),
                  metric(cluster[d].url, "pdserve:kv_remote_prompt_tokens_total"),
                  metric(cluster[d].url, "pdserve:prefix_cache_hit_tokens_total"),
                  metric(cluster[d].url, "pdserve:request_success_total", 'finish_reason="length"'))
              for d in ("d_shm", "d_tcp")}
    prompt_tokens = 0
    for p in PROMPTS[:4]:
        out = proxy.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        prompt_tokens += out.usage.prompt_tokens
    # With logprobs (P's first token's are not carried), D computes the last prompt token itself.
    with_logprobs = proxy.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=8, temperature=0, logprobs=1,
                                             extra_body={"ignore_eos": True})
    assert len(with_logprobs.choices[0].logprobs.token_logprobs) == 8
    served = computed = remote = cached = 0
    for d, (c0, r0, h0, s0) in before.items():
        served += metric(cluster[d].url, "pdserve:request_success_total", 'finish_reason="length"') - s0
        computed += metric(cluster[d].url, "pdserve:prefill_tokens_computed_total") - c0
        remote += metric(cluster[d].url, "pdserve:kv_remote_prompt_tokens_total") - r0
        cached += metric(cluster[d].url, "pdserve:prefix_cache_hit_tokens_total") - h0
    assert served == 5
    assert computed == 1  # D decodes from P's first token; only the logprobs request's last prompt token
    # Everything else came from P, or from D's own prefix cache: blocks D loaded for an earlier test's
    # request of the same prompt stay cached there, and D pulls only what it lacks.
    assert cached % 16 == 0
    assert remote + cached == prompt_tokens + with_logprobs.usage.prompt_tokens - 1
    for name in ("p", "d_shm", "d_tcp"):
        assert wait_for_metric(cluster[name].url, "pdserve:kv_blocks_used", 0) == 0
        assert wait_for_metric(cluster[name].url, "pdserve:kv_blocks_held", 0) == 0


def test_d_decodes_from_ps_first_token_where_it_may_and_samples_it_itself_where_not(cluster):
    """One token asked: D answers with P's first token once the KV is in, computing nothing, and
    frees its blocks. A seeded draw, and n = 2, D samples itself from the last prompt token (P's
    token would leave D's generator a draw behind): the same tokens as the colocated node."""
    reference, proxy = client(cluster["both"].url), client(cluster["proxy"].url)
    computed = {d: metric(cluster[d].url, "pdserve:prefill_tokens_computed_total") for d in ("d_shm", "d_tcp")}
    one = proxy.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1, temperature=0)
    assert one.choices[0].text == reference.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1,
                                                                temperature=0).choices[0].text
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    assert sum(metric(cluster[d].url, "pdserve:prefill_tokens_computed_total") - c for d, c in computed.items()) == 0
    for kwargs in ({"temperature": 0.9, "seed": 7}, {"temperature": 0, "n": 2}):
        ask = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, **kwargs)
        expected = [c.text for c in reference.completions.create(**ask).choices]
        assert [c.text for c in proxy.completions.create(**ask).choices] == expected
    for name in ("p", "d_shm", "d_tcp"):
        assert wait_for_metric(cluster[name].url, "pdserve:kv_blocks_used", 0) == 0


def test_ps_first_token_streams_as_the_kv_lands_not_after_ds_next_model_run(cluster):
    """A pulled prompt's first token (P's) is ready the moment D's engine reads the finished pull:
    it reaches the client then, not with the outputs of the step that follows (a decode step of
    TTFT, idle or loaded). A D engine in this process pulls for real from the cluster's P process;
    the order of events on its engine thread is the evidence."""
    engine = LLMEngine(EngineConfig(dtype="float32", quantization="none", num_kv_blocks=64,
                                    kv_transfer=KVTransferConfig(role="decode", transport="tcp")))
    events: list[tuple[str, int]] = []
    run = engine.model_runner.run

    def spied_run(scheduled, *args, **kwargs):
        if scheduled.scheduled:  # (a step with nothing to compute runs no model)
            events.append(("model run", len(scheduled.scheduled)))
        return run(scheduled, *args, **kwargs)

    engine.model_runner.run = spied_run  # a spy: the real run goes on
    d = ThreadedEngineClient(engine, on_step=lambda outputs: events.extend(
        ("tokens out", len(out.new_token_ids)) for out in outputs if out.new_token_ids))
    prompt_ids = engine.tokenizer.encode(PROMPTS[3])
    answer = httpx.post(cluster["p"].url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()

    async def decode() -> list[RequestOutput]:
        d.start()
        try:
            checked = engine.check_request(prompt_ids, SamplingParams(max_tokens=3, temperature=0.0),
                                           parse_kv_transfer_params(answer["kv_transfer_params"]))
            return [out async for out in d.generate("R", checked)]
        finally:
            d.stop()

    outputs = asyncio.run(decode())
    expected = client(cluster["both"].url).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=3,
                                                              temperature=0)
    assert engine.tokenizer.decode([t for out in outputs for t in out.new_token_ids]) == expected.choices[0].text
    assert outputs[-1].metrics.num_remote_tokens == len(prompt_ids)  # pulled whole: P's first token given
    # P's token out before any model run (nothing of the prompt is computed here), then D's two
    assert events == [("tokens out", 1), ("model run", 1), ("tokens out", 1), ("model run", 1), ("tokens out", 1)]


def test_p_advertises_the_transports_it_serves_and_nothing_of_their_own(cluster):
    """vLLM's toy-proxy protocol by hand: P's kv_transfer_params name the transports its side
    channel serves (its pool is in shared memory: shm and tcp, then any transfer engine installed);
    what shm needs (the segment names) comes in shm's own handshake on the side channel, so no shm
    field is in the params, and D given them as they came pulls over shm and answers as the
    colocated node does."""
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0}
    r = httpx.post(cluster["p"].url + "/v1/completions", timeout=60,
                   json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = r.json()["kv_transfer_params"]
    assert r.status_code == 200 and params["remote_transports"][:2] == ["shm", "tcp"]
    assert not [k for k in params if "shm" in k]
    before = metric(cluster["d_shm"].url, "pdserve:kv_transfer_bytes_total", 'direction="received"')
    d = httpx.post(cluster["d_shm"].url + "/v1/completions", timeout=60, json={**body, "kv_transfer_params": params})
    expected = httpx.post(cluster["both"].url + "/v1/completions", timeout=60, json=body).json()["choices"][0]["text"]
    assert d.status_code == 200 and d.json()["choices"][0]["text"] == expected
    assert metric(cluster["d_shm"].url, "pdserve:kv_transfer_bytes_total", 'direction="received"') > before
    assert wait_for_metric(cluster["p"].url, "pdserve:kv_blocks_used", 0) == 0


def test_a_bad_first_token_is_refused_before_any_load(cluster):
    fake_p = {"do_remote_prefill": True, "remote_request_id": "r", "remote_block_ids": [0], "remote_host": "127.0.0.1",
              "remote_port": 1}
    for bad, says in ((10**9, "outside the vocabulary"), (-1, "first_token_id")):
        r = httpx.post(cluster["d_tcp"].url + "/v1/completions", timeout=30,
                       json={"prompt": "hello world", "max_tokens": 4, "kv_transfer_params": {**fake_p, "first_token_id": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert says in r.json()["error"]["message"]


def test_proxy_relays_node_errors_with_openai_body(cluster):
    url = cluster["proxy"].url
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [MODEL]


def test_decode_node_rejects_bad_kv_transfer_params(cluster):
    d = cluster["d_tcp"].url
    r = httpx.post(d + "/v1/completions", json={"prompt": "hello world", "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(cluster["both"].url + "/v1/completions", json={"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400


@pytest.mark.parametrize("policy, status", [("recompute", 200), ("fail", 502)])
def test_load_from_dead_prefill_node(tmp_path, cluster, policy, status):
    """P unreachable: recompute prefills locally (same answer); fail returns a clean 502."""
    d = start_pdserve(["serve", "--role", "decode", "--kv-load-failure-policy", policy, "--kv-wait-timeout", "2", *NODE],
                      tmp_path, f"d_{policy}")
    try:
        params = {"do_remote_prefill": True, "remote_block_ids": [0, 1], "remote_host": "127.0.0.1",
                  "remote_port": free_port(), "remote_request_id": "gone", "remote_engine_id": "x"}
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
        r = httpx.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
        assert r.status_code == status, r.text
        if status == 200:
            expected = httpx.post(cluster["both"].url + "/v1/completions", json=body, timeout=60).json()
            assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        else:
            assert "KV transfer" in r.json()["error"]["message"]
        assert metric(d.url, "pdserve:kv_transfers_failed_total") == 1
        assert wait_for_metric(d.url, "pdserve:kv_blocks_used", 0) == 0
    finally:
        d.stop()


ROME, SOUP = "The history of the Roman empire begins", "My favourite recipe for tomato soup is"


@pytest.mark.parametrize("policy, status", [("recompute", 200), ("fail", 502)])
def test_d_given_another_prompts_kv_transfer_params_never_answers_from_that_kv(tmp_path, cluster, policy, status):
    """Issue 39's report, in vLLM's protocol: P prefills prompt A; D is asked for prompt B with A's
    kv_transfer_params. D used to answer 200 with A's continuation. Now P refuses the pull (the KV
    is of another prompt): recompute answers B as a colocated node does, fail is a 502 naming why;
    P's hold stays for the right request, which then loads it."""
    p = cluster["p"].url
    fail_d = None if policy == "recompute" else start_pdserve(
        ["serve", "--role", "decode", "--kv-load-failure-policy", "fail", *NODE], tmp_path, "d_fail")
    try:
        check_refused_and_kept(p, cluster["both"].url, [fail_d.url] if fail_d else [cluster["d_tcp"].url,
                                                                                 cluster["d_shm"].url], status)
    finally:
        if fail_d:
            fail_d.stop()


def check_refused_and_kept(p: str, colocated_url: str, ds: list[str], status: int) -> None:
    def body(prompt: str) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}

    answers = {t: httpx.post(colocated_url + "/v1/completions", json=body(t), timeout=120).json() for t in (ROME, SOUP)}
    colocated = {t: a["choices"][0]["text"] for t, a in answers.items()}
    assert colocated[ROME] != colocated[SOUP]
    assert answers[ROME]["usage"]["prompt_tokens"] == answers[SOUP]["usage"]["prompt_tokens"]  # as in the report
    for d in ds:
        for asked, prefilled in ((SOUP, ROME), (ROME, SOUP)):
            params = httpx.post(p + "/v1/completions", timeout=120, json={
                **body(prefilled), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()[
                "kv_transfer_params"]
            failed = metric(d, "pdserve:kv_transfers_failed_total")
            r = httpx.post(d + "/v1/completions", json={**body(asked), "kv_transfer_params": params}, timeout=120)
            assert r.status_code == status, r.text
            if status == 200:
                assert r.json()["choices"][0]["text"] == colocated[asked]
            else:
                assert "another prompt" in r.json()["error"]["message"], r.text
            assert metric(d, "pdserve:kv_transfers_failed_total") == failed + 1
            # The hold was kept for the request it belongs to: that one loads it and answers right.
            r = httpx.post(d + "/v1/completions", json={**body(prefilled), "kv_transfer_params": params}, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == colocated[prefilled]
            assert metric(d, "pdserve:kv_transfers_failed_total") == failed + 1
        assert wait_for_metric(d, "pdserve:kv_blocks_used", 0) == 0
    assert wait_for_metric(p, "pdserve:kv_blocks_used", 0) == 0


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL])
def test_pdserve_up_serves_openai_client_and_leaves_no_orphans(tmp_path, stop_signal):
    up = up_child(["--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.15"], log_path=str(tmp_path / "up.log"))
    up.start()
    try:
        ProcessGroup().wait_ready([up], 180)
        out = client(up.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0)
        assert out.choices[0].message.content == "The capital of France is Paris."
        kids = children(up.proc.pid)
        assert len(kids) == 3  # P, D, proxy
        up.proc.send_signal(stop_signal)
        assert up.proc.wait(30) == (0 if stop_signal == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 15
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if alive(k)]
    finally:
        if up.alive():
            up.proc.kill()
        for k in children(up.proc.pid):
            os.kill(k, signal.SIGKILL)


def test_mismatched_kv_secret_moves_no_block(tmp_path, cluster):
    """P and D with different secrets: P refuses (and logs) the pull, D recomputes, nothing leaks."""
    p = start_pdserve(["serve", "--role", "prefill", "--kv-secret", "alpha", *NODE], tmp_path, "p_alpha")
    d = start_pdserve(["serve", "--role", "decode", "--kv-secret", "beta", *NODE], tmp_path, "d_beta")
    proxy = start_pdserve(["proxy", "--prefill", p.url, "--decode", d.url], tmp_path, "proxy_mismatch")
    try:
        body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}
        got = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        expected = httpx.post(cluster["both"].url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert got == expected  # D prefilled locally (recompute)
        assert metric(d.url, "pdserve:kv_transfers_failed_total") == 1
        assert metric(d.url, "pdserve:kv_transfer_bytes_total", 'direction="received"') == 0
        assert "refused connection" in p.log()
        assert wait_for_metric(p.url, "pdserve:kv_blocks_held", 0, timeout=5) > 0  # still held for its D
    finally:
        for proc in (proxy, d, p):
            proc.stop()


def test_dead_prefill_node_is_skipped_and_leaves_rotation(tmp_path, cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_pdserve(["proxy", "--prefill", dead, cluster["p"].url, "--decode", cluster["d_tcp"].url],
                          tmp_path, "proxy_dead_p")
    try:
        c = client(proxy.url)
        for p in PROMPTS[:3]:  # round robin would pick the dead P for some: the proxy retries on the live one
            out = c.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
            assert out.usage.completion_tokens == 4
        nodes = {n["url"]: n for n in httpx.get(proxy.url + "/v1/nodes").json()["nodes"]}
        assert nodes[dead]["healthy"] is False and nodes[dead]["served"] == 0
        assert nodes[cluster["p"].url]["healthy"] is True and nodes[cluster["p"].url]["served"] == 3
    finally:
        proxy.stop()


def test_dead_decode_node_is_skipped_and_leaves_rotation(tmp_path, cluster):
    """Nothing streamed yet: a D that cannot be reached is taken out and another D answers."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_pdserve(["proxy", "--prefill", cluster["p"].url, "--decode", dead, cluster["d_tcp"].url],
                          tmp_path, "proxy_dead_d")
    try:
        c = client(proxy.url)
        for stream in (False, True, False):
            out = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, stream=stream)
            chunks = list(out) if stream else [out]
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
        nodes = {n["url"]: n for n in httpx.get(proxy.url + "/v1/nodes").json()["nodes"]}
        assert nodes[dead]["healthy"] is False and nodes[dead]["served"] == 0
        assert nodes[cluster["d_tcp"].url]["served"] == 3
    finally:
        proxy.stop()


def test_admin_api_and_nodes_file_change_membership_at_run_time(tmp_path, cluster):
    p, d_shm, d_tcp = cluster["p"].url, cluster["d_shm"].url, cluster["d_tcp"].url
    nodes_file = tmp_path / "nodes.json"
    nodes_file.write_text(json.dumps({"prefill": [p], "decode": [d_tcp]}))
    proxy = start_pdserve(["proxy", "--nodes-file", str(nodes_file), "--api-key", "sesame"], tmp_path, "proxy_admin")
    key = {"Authorization": "Bearer sesame"}
    listed = lambda: {(n["role"], n["url"]) for n in httpx.get(proxy.url + "/v1/nodes", headers=key).json()["nodes"]}  # noqa: E731
    try:
        assert listed() == {("prefill", p), ("decode", d_tcp)}
        admin = proxy.url + "/v1/admin/nodes"
        assert httpx.post(admin, json={"url": d_shm, "role": "decode"}).status_code == 401
        r = httpx.post(admin, json={"url": d_shm, "role": "decode"}, headers=key)
        assert r.status_code == 201 and r.json()["url"] == d_shm
        assert httpx.post(admin, json={"url": d_shm, "role": "decode"}, headers=key).status_code == 409
        bad = httpx.post(admin, json={"url": d_shm, "role": "both"}, headers=key)
        assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
        assert httpx.post(admin, json={"url": "not a url", "role": "decode"}, headers=key).status_code == 400
        assert httpx.request("DELETE", admin, params={"url": d_tcp}, headers=key).status_code == 200
        assert httpx.request("DELETE", admin, params={"url": d_tcp}, headers=key).status_code == 404
        assert listed() == {("prefill", p), ("decode", d_shm)}
        body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 3, "temperature": 0}
        for _ in range(2):
            assert httpx.post(proxy.url + "/v1/completions", json=body, headers=key, timeout=60).status_code == 200
        served = {n["url"]: n["served"] for n in httpx.get(proxy.url + "/v1/nodes", headers=key).json()["nodes"]}
        assert served[d_shm] == 2
        # The file changes: d_tcp comes back, the prefill node listed there stays.
        nodes_file.write_text(json.dumps({"prefill": [p], "decode": [d_tcp, d_shm]}))
        deadline = time.monotonic() + 10
        while listed() != {("prefill", p), ("decode", d_tcp), ("decode", d_shm)} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert listed() == {("prefill", p), ("decode", d_tcp), ("decode", d_shm)}
        nodes_file.write_text("{not json")  # a broken file is logged and ignored
        time.sleep(2.5)
        assert len(listed()) == 3 and "keeping the current nodes" in proxy.log()
    finally:
        proxy.stop()


def test_admin_api_is_shut_without_an_api_key(tmp_path, cluster):
    proxy = start_pdserve(["proxy", "--prefill", cluster["p"].url, "--decode", cluster["d_tcp"].url], tmp_path,
                          "proxy_open")
    try:
        r = httpx.post(proxy.url + "/v1/admin/nodes", json={"url": cluster["d_shm"].url, "role": "decode"})
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
        assert len(httpx.get(proxy.url + "/v1/nodes").json()["nodes"]) == 2
    finally:
        proxy.stop()
