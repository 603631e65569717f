"""Admission guards on real processes: API keys, body size limit, bounded waiting queue (429)."""

from __future__ import annotations

import threading

import httpx
import pytest
from servers import start_pdserve, wait_for_metric

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guards")
    node = start_pdserve(["serve", "--kv-cache-memory", "0.1", "--api-key", KEY, "--max-waiting", "1",
                          "--max-num-seqs", "1", "--max-body-bytes", "4000"], tmp, "node")
    proxy = start_pdserve(["proxy", "--mode", "colocated", "--node", node.url, "--api-key", KEY], tmp, "proxy")
    yield node, proxy
    proxy.stop()
    node.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("which", [0, 1])
def test_api_key_required_on_the_api_but_not_on_health(guarded, which):
    url = guarded[which].url
    body = {"prompt": "Hello", "max_tokens": 2}
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, auth("wrong")):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models").status_code == 401
    r = httpx.post(url + "/v1/completions", json=body, headers=auth(KEY), timeout=60)
    assert r.status_code == 200, r.text  # through the proxy too: it sends the key on


def test_oversized_body_gets_413(guarded):
    node, _ = guarded
    r = httpx.post(node.url + "/v1/completions", json={"prompt": "x" * 5000}, headers=auth(KEY))
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_full_queue_answers_429_with_retry_after(guarded):
    node, _ = guarded
    long = {"prompt": "Count slowly:", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", node.url + "/v1/completions", json={**long, "stream": True}, headers=auth(KEY),
                      timeout=60) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it would close the stream
        next(lines)  # running now (max_num_seqs 1)
        waiting = threading.Thread(target=httpx.post, args=(node.url + "/v1/completions",),
                                   kwargs={"json": long, "headers": auth(KEY), "timeout": 120})
        waiting.start()
        assert wait_for_metric(node.url, "pdserve:num_requests_waiting", 1) == 1
        r = httpx.post(node.url + "/v1/completions", json=long, headers=auth(KEY))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    waiting.join(120)
    assert wait_for_metric(node.url, "pdserve:kv_blocks_used", 0) == 0
