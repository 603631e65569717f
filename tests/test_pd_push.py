"""Layer-wise push end to end: push = pull = colocated, blocks back to zero, and its failures."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from servers import Procs, free_port, metric, start_pdserve, wait_for_metric
from test_pd_pull import MODEL, NODE, PROMPTS, client

LONG_PROMPT = " ".join(f"Item {i}: a sentence about the number {i} and its square {i * i}." for i in range(150))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("push")) as procs:
        procs.start(["serve", "--role", "both", *NODE], "both")
        # Chunked prefill on P (256-token steps): a long prompt is pushed across several steps.
        p = procs.start(["serve", "--role", "prefill", "--max-num-batched-tokens", "256", *NODE], "p")
        # D waits up to 120 s for a push (30 by default): on a slow, loaded CI machine P's queue of
        # nine prompts, one of 2000+ tokens in 256-token chunks, can take longer than 30 s.
        decoders = [procs.start(["serve", "--role", "decode", "--kv-transport", transport, "--kv-wait-timeout", "120",
                                 *NODE], f"d_{transport}").url for transport in ("shm", "tcp")]
        procs.start(["proxy", "--mode", "push", "--prefill", p.url, "--decode", *decoders], "push")
        procs.start(["proxy", "--mode", "pull", "--prefill", p.url, "--decode", *decoders], "pull")
        yield procs


def ask(url: str, prompt: str, stream: bool, max_tokens: int = 24) -> tuple[str, int]:
    c = client(url)
    if stream:
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text, out.usage.completion_tokens


def test_push_equals_pull_equals_colocated(cluster):
    prompts = PROMPTS + [LONG_PROMPT]
    colocated = [ask(cluster["both"].url, p, False) for p in prompts]
    r = httpx.post(cluster["both"].url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] > 2000
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        push = list(pool.map(lambda i: ask(cluster["push"].url, prompts[i], bool(i % 2)), range(len(prompts))))
        pull = list(pool.map(lambda i: ask(cluster["pull"].url, prompts[i], not i % 2), range(len(prompts))))
    assert push == colocated
    assert pull == colocated
    for name in ("p", "d_shm", "d_tcp"):
        assert wait_for_metric(cluster[name].url, "pdserve:kv_blocks_used", 0) == 0
        assert metric(cluster[name].url, "pdserve:kv_blocks_held") == 0
    for name in ("d_shm", "d_tcp"):  # every transfer passed the handoff's checks (digests on): none recomputed
        assert metric(cluster[name].url, "pdserve:kv_transfers_failed_total") == 0
        assert metric(cluster[name].url, "pdserve:kv_transfer_bytes_total", 'direction="received"') > 0


def test_sampling_controls_and_logprobs_through_push_and_pull_equal_colocated(cluster):
    """Penalties, logit_bias and min_tokens: P computes the prompt (and its one token obeys them),
    D the rest; greedy output and its logprobs equal to the colocated node's. A field pdserve
    refuses is P's or D's 400, relayed with its name."""
    ask = {"model": MODEL, "prompt": "The cat sat on the mat. The cat sat on the mat. The", "max_tokens": 16,
           "temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2,
           "logit_bias": {"338": 3.0}, "min_tokens": 4, "logprobs": 3}
    expected = httpx.post(cluster["both"].url + "/v1/completions", json=ask, timeout=120).json()["choices"][0]
    for mode in ("push", "pull"):
        got = httpx.post(cluster[mode].url + "/v1/completions", json=ask, timeout=120)
        assert got.status_code == 200, (mode, got.text)
        choice = got.json()["choices"][0]
        assert choice["text"] == expected["text"] and choice["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-4)
        refused = httpx.post(cluster[mode].url + "/v1/completions", json={**ask, "best_of": 2}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of", (mode, refused.text)


def test_a_stop_string_across_tokens_through_push_and_pull(cluster):
    """The end of one token and the start of the next as a stop string: D stops where the colocated
    node stops, whole and streamed (the held-back text never leaks into the stream)."""
    ask = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = httpx.post(cluster["both"].url + "/v1/completions", json={**ask, "logprobs": 0}, timeout=120).json()
    text, tokens = free["choices"][0]["text"], free["choices"][0]["logprobs"]["tokens"]
    i = next(i for i in range(2, len(tokens)) if len(tokens[i - 1]) >= 2 and len(tokens[i]) >= 2)
    stop = tokens[i - 1][-2:] + tokens[i][:2]
    expected = text[: text.index(stop)]
    for mode in ("push", "pull"):
        got = httpx.post(cluster[mode].url + "/v1/completions", json={**ask, "stop": [stop]}, timeout=120).json()
        assert (got["choices"][0]["text"], got["choices"][0]["finish_reason"]) == (expected, "stop"), mode
        streamed = ""
        with httpx.stream("POST", cluster[mode].url + "/v1/completions", json={**ask, "stop": [stop], "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == expected, mode


def test_echo_and_prompt_logprobs_come_from_p_through_push_and_pull(cluster):
    """lm-evaluation-harness's scoring call through the proxy: P computes the prompt and reports its
    logprobs, D the answer; the proxy puts P's part first. Equal to the colocated node's, whole and
    streamed; vLLM's prompt_logprobs field too. With max_tokens 0, P alone answers."""
    score = {"model": MODEL, "prompt": "The cat sat on the mat because it was", "echo": True, "logprobs": 2,
             "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1}
    expected = httpx.post(cluster["both"].url + "/v1/completions", json=score, timeout=120).json()["choices"][0]
    n = len(expected["prompt_logprobs"])
    for mode in ("push", "pull"):
        got = httpx.post(cluster[mode].url + "/v1/completions", json=score, timeout=120)
        assert got.status_code == 200, (mode, got.text)
        choice = got.json()["choices"][0]
        assert choice["text"] == expected["text"] and choice["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
        assert choice["logprobs"]["text_offset"] == expected["logprobs"]["text_offset"]
        assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == n + 3
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected["logprobs"]["token_logprobs"][1:], abs=1e-4)
        assert [p and sorted(p) for p in choice["prompt_logprobs"]] == [p and sorted(p) for p in expected["prompt_logprobs"]]
        tokens, offsets, text = [], [], ""
        with httpx.stream("POST", cluster[mode].url + "/v1/completions", json={**score, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    text += c["text"]
                    tokens += (c["logprobs"] or {}).get("tokens", [])
                    offsets += (c["logprobs"] or {}).get("text_offset", [])
        assert text == expected["text"] and tokens == expected["logprobs"]["tokens"], mode
        assert offsets == expected["logprobs"]["text_offset"], mode
        zero = httpx.post(cluster[mode].url + "/v1/completions", json={**score, "max_tokens": 0}, timeout=120)
        assert zero.status_code == 200, (mode, zero.text)
        zero = zero.json()["choices"][0]
        assert zero["text"] == score["prompt"] and zero["finish_reason"] == "length"
        assert zero["logprobs"]["tokens"] == expected["logprobs"]["tokens"][:n]
    assert wait_for_metric(cluster["p"].url, "pdserve:kv_blocks_held", 0, timeout=10) == 0  # nothing left held


def test_n_sequences_through_push_and_pull_are_one_prefill_and_n_decodes(cluster):
    """n = 3, seeded: P prefills once (its request asks for one sequence), D decodes three from the
    one KV handoff; each choice equals the colocated node's, whole and streamed (echo before each)."""
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 10, "temperature": 0.9, "seed": 21, "n": 3,
            "ignore_eos": True, "echo": True}
    expected = httpx.post(cluster["both"].url + "/v1/completions", json=body, timeout=120).json()["choices"]
    assert len({c["text"] for c in expected}) > 1
    for mode in ("push", "pull"):
        prompts_before = metric(cluster["p"].url, "pdserve:prompt_tokens_total")
        got = httpx.post(cluster[mode].url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 200, (mode, got.text)
        assert [(c["index"], c["text"]) for c in got.json()["choices"]] == [(c["index"], c["text"]) for c in expected]
        assert got.json()["usage"]["completion_tokens"] == 30
        assert metric(cluster["p"].url, "pdserve:prompt_tokens_total") - prompts_before == got.json()["usage"]["prompt_tokens"]
        texts: dict[int, str] = {}
        with httpx.stream("POST", cluster[mode].url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        assert texts == {c["index"]: c["text"] for c in expected}, mode
    for name in ("p", "d_shm", "d_tcp"):
        assert wait_for_metric(cluster[name].url, "pdserve:kv_blocks_used", 0) == 0


def test_structured_output_through_push_and_pull_equals_colocated(cluster):
    """A JSON schema through PD: P's one token and D's answer obey it, and the answer equals the
    colocated node's (greedy); a constraint that does not compile is P's 400, naming its field."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a big city as JSON."}], "max_tokens": 60,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    expected = httpx.post(cluster["both"].url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert set(json.loads(expected["message"]["content"])) == {"city", "country"}
    first = httpx.post(cluster["p"].url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=120).json()
    assert first["choices"][0]["message"]["content"] == expected["message"]["content"][:len(first["choices"][0]["message"]["content"])]
    for mode in ("push", "pull"):
        got = httpx.post(cluster[mode].url + "/v1/chat/completions", json=body, timeout=120)
        assert got.status_code == 200, (mode, got.text)
        assert got.json()["choices"][0]["message"]["content"] == expected["message"]["content"], mode
        bad = httpx.post(cluster[mode].url + "/v1/completions", timeout=60,
                         json={"model": MODEL, "prompt": "x", "guided_regex": "[unclosed"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex", (mode, bad.text)


def test_tool_calls_through_push_and_pull_equal_colocated(cluster):
    """P renders the same prompt with the tools (its KV is D's), D's answer is parsed into calls."""
    from test_tools import TIME, WEATHER

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Lima, and the time there?"}],
            "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 100, "temperature": 0}

    def calls(answer: dict) -> list[tuple[str, str]]:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in answer["choices"][0]["message"]["tool_calls"]]

    expected = httpx.post(cluster["both"].url + "/v1/chat/completions", json=body, timeout=120).json()
    assert calls(expected) and expected["choices"][0]["finish_reason"] == "tool_calls"
    for mode in ("push", "pull"):
        got = httpx.post(cluster[mode].url + "/v1/chat/completions", json=body, timeout=120)
        assert got.status_code == 200, (mode, got.text)
        assert calls(got.json()) == calls(expected) and got.json()["usage"] == expected["usage"], mode
        streamed = []
        with httpx.stream("POST", cluster[mode].url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    streamed += json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == calls(expected), mode


def test_push_moves_bytes_over_both_transports_and_p_holds_nothing(cluster):
    before = {d: metric(cluster[d].url, "pdserve:kv_transfer_bytes_total", 'direction="received"') for d in ("d_shm", "d_tcp")}
    for p in PROMPTS[:2]:
        ask(cluster["push"].url, p, True, max_tokens=4)
    for d in ("d_shm", "d_tcp"):
        assert metric(cluster[d].url, "pdserve:kv_transfer_bytes_total", 'direction="received"') > before[d]
    assert metric(cluster["p"].url, "pdserve:kv_blocks_held") == 0
    assert metric(cluster["p"].url, "pdserve:kv_blocks_used") == 0


def test_d_decodes_from_the_first_token_p_pushed(cluster):
    """Greedy, one sequence: D asks P for the whole prompt's KV and the first token P sampled, and
    decodes from it, computing no prompt token; a one-token answer is P's token. Asking for
    logprobs (P's are not carried), D computes the last prompt token itself."""
    def computed() -> float:
        return sum(metric(cluster[d].url, "pdserve:prefill_tokens_computed_total") for d in ("d_shm", "d_tcp"))

    before = computed()
    for i, p in enumerate(PROMPTS[:4]):
        assert ask(cluster["push"].url, p, bool(i % 2), max_tokens=8) == ask(cluster["both"].url, p, False, 8)
    assert ask(cluster["push"].url, PROMPTS[6], False, max_tokens=1) == ask(cluster["both"].url, PROMPTS[6], False, 1)
    assert computed() == before
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 8, "temperature": 0, "logprobs": 1}
    expected = httpx.post(cluster["both"].url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    got = httpx.post(cluster["push"].url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert got["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
    assert computed() == before + 1


def test_client_gone_mid_push_frees_blocks_on_both_sides(cluster):
    """The client leaves while P is still prefilling (and pushing) a long prompt."""
    fresh = " ".join(f"Line {i}: a different text about the cube of {i}, {i ** 3}." for i in range(80))  # no cache hits
    body = {"model": MODEL, "prompt": fresh, "max_tokens": 50, "temperature": 0, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", cluster["push"].url + "/v1/completions", json=body, timeout=0.8) as r:
            for _ in r.iter_lines():
                pass
    for name in ("p", "d_shm", "d_tcp"):
        assert wait_for_metric(cluster[name].url, "pdserve:kv_blocks_used", 0, timeout=20) == 0
    assert ask(cluster["push"].url, PROMPTS[0], False) == ask(cluster["both"].url, PROMPTS[0], False)


@pytest.mark.parametrize("policy, status", [("recompute", 200), ("fail", 502)])
def test_no_push_arrives_then_policy_applies(tmp_path, cluster, policy, status):
    """D waits for a push that never comes (the P side is gone): after --kv-wait-timeout it either
    prefills locally or answers a clean error; nothing hangs and no block leaks."""
    d = start_pdserve(["serve", "--role", "decode", "--kv-wait-timeout", "2", "--kv-load-failure-policy", policy, *NODE],
                      tmp_path, f"d_{policy}")
    meta = start_pdserve(["proxy", "--mode", "push", "--prefill", f"http://127.0.0.1:{free_port()}", "--decode", d.url],
                         tmp_path, f"proxy_{policy}")
    try:
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
        start = time.monotonic()
        r = httpx.post(meta.url + "/v1/completions", json=body, timeout=60)
        # The proxy cannot reach the (dead) P: it answers 502 (or 503 once health checks took P out of
        # rotation) and closes D's request at once.
        assert r.status_code in (502, 503)
        assert any(w in r.json()["error"]["message"] for w in ("unreachable", "no healthy"))
        assert wait_for_metric(d.url, "pdserve:kv_blocks_used", 0, timeout=10) == 0
        # D on its own, told to expect a push nobody sends (as if P died before its first layer).
        params = {"do_remote_prefill": True, "kv_mode": "push", "metaserver": meta.url + "/v1/kv/meta",
                  "proxy_request_id": "nobody-waits"}
        start = time.monotonic()
        r = httpx.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
        assert r.status_code == status, r.text
        assert time.monotonic() - start < 15
        if status == 200:
            assert r.json()["choices"][0]["text"] == ask(cluster["both"].url, PROMPTS[1], False, 12)[0]
        assert wait_for_metric(d.url, "pdserve:kv_blocks_used", 0) == 0
    finally:
        meta.stop()
        d.stop()


def test_prefill_node_killed_mid_push(tmp_path):
    """P dies while pushing a long prompt: the client gets a clean error quickly, D frees its blocks."""
    p = start_pdserve(["serve", "--role", "prefill", "--max-num-batched-tokens", "128", *NODE], tmp_path, "p_doomed")
    d = start_pdserve(["serve", "--role", "decode", "--kv-wait-timeout", "5", *NODE], tmp_path, "d_survivor")
    proxy = start_pdserve(["proxy", "--mode", "push", "--prefill", p.url, "--decode", d.url], tmp_path, "proxy_doomed")
    try:
        fresh = " ".join(f"Row {i}: yet another text, about {i} squared minus one, {i * i - 1}." for i in range(80))
        body = {"model": MODEL, "prompt": fresh, "max_tokens": 16, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(httpx.post, proxy.url + "/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while metric(d.url, "pdserve:num_requests_waiting_for_remote_kv") == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # P is now prefilling chunk after chunk, pushing each layer
            p.proc.kill()
            start = time.monotonic()
            r = future.result()
        assert r.status_code in (502, 503, 504), r.text
        assert r.json()["error"]["message"]
        assert time.monotonic() - start < 10
        assert wait_for_metric(d.url, "pdserve:kv_blocks_used", 0, timeout=10) == 0
        assert metric(d.url, "pdserve:num_requests_waiting_for_remote_kv") == 0
        assert httpx.get(d.url + "/health").status_code == 200
    finally:
        for proc in (proxy, d, p):
            proc.stop()
