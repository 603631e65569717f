"""The field's transfer engines as KV transports, end to end: real P, D and proxy processes over
`--kv-transport mooncake` (the Mooncake Transfer Engine, its tcp protocol here) and `nixl` (NIXL on
UCX), pull and layer-wise push, and a P of TP 1 feeding a D of TP 3 (each D rank reads one head of
P's pool: one entry per token slot). Every answer equals the colocated node's, token for token; the
bytes are counted under the engine's label on both ends, and every block comes back. An engine
that is not installed here is skipped, the reason printed."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import httpx
import pytest
from servers import Procs, metric, pdserve_child, start_pdserve, wait_for_metric, wait_ready
from test_pd_pull import MODEL, NODE, PROMPTS, client

from pdserve.kv.transport import transport_class

ENGINES = ["mooncake", "nixl"]


@pytest.fixture(scope="module", params=ENGINES)
def cluster(request, tmp_path_factory):
    engine = request.param
    missing = transport_class(engine).unavailable()
    if missing:
        pytest.skip(f"{engine} transport unavailable: {missing}")
    with Procs(tmp_path_factory.mktemp(engine)) as procs:
        procs.start(["serve", "--role", "both", *NODE], "both")
        # P drives a push (its --kv-transport), D a pull (its own)
        p = procs.start(["serve", "--role", "prefill", "--max-num-batched-tokens", "256", "--kv-transport", engine,
                         *NODE], "p")
        d = procs.start(["serve", "--role", "decode", "--kv-transport", engine, "--kv-wait-timeout", "120",
                         *NODE], "d")
        d3 = procs.start(["serve", "--role", "decode", "-tp", "3", "--kv-transport", engine, *NODE], "d3")
        procs.start(["proxy", "--mode", "pull", "--prefill", p.url, "--decode", d.url], "pull")
        procs.start(["proxy", "--mode", "push", "--prefill", p.url, "--decode", d.url], "push")
        procs.start(["proxy", "--mode", "pull", "--prefill", p.url, "--decode", d3.url], "pull_tp3")
        yield engine, procs


def answer(url: str, prompt: str, max_tokens: int = 24) -> str:
    out = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


@pytest.mark.parametrize("proxy, decoder", [("pull", "d"), ("push", "d"), ("pull_tp3", "d3")])
def test_pull_push_and_a_tp_pair_over_a_transfer_engine_equal_colocated(cluster, proxy, decoder):
    engine, cluster = cluster
    expected = [answer(cluster["both"].url, p) for p in PROMPTS[:4]]
    d_url, p_url = cluster[decoder].url, cluster["p"].url
    label = f'direction="received",transport="{engine}"'
    before = metric(d_url, "pdserve:kv_transfer_bytes_total", label)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: answer(cluster[proxy].url, p), PROMPTS[:4]))
    assert got == expected
    assert metric(d_url, "pdserve:kv_transfer_bytes_total", label) > before
    assert metric(d_url, "pdserve:kv_transfer_bytes_total", 'direction="received",transport="tcp"') == 0
    if proxy == "push":  # P pushes: it counts what it wrote under the same label
        assert metric(p_url, "pdserve:kv_transfer_bytes_total", f'direction="sent",transport="{engine}"') > 0
    for name in ("p", decoder):
        assert wait_for_metric(cluster[name].url, "pdserve:kv_blocks_used", 0) == 0
        assert metric(cluster[name].url, "pdserve:kv_blocks_held") == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_transfer_engine_that_cannot_load_is_an_error_naming_it(tmp_path, command, engine):
    """`serve` or `up` asked for a transport whose library cannot load stops before any node
    starts, with the CLI's one error line naming the flag and the missing library (here a path
    entry shadows the package in the child)."""
    shadow = tmp_path / engine  # the package's import name
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    args = ["serve", "--role", "decode", *NODE] if command == "serve" else ["up"]
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", *args, "--kv-transport", engine],
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.returncode == 2 and len(errors) == 1, run.stderr
    assert f"--kv-transport {engine}" in errors[0] and "libibverbs.so.1" in errors[0]
    assert "Uvicorn running" not in run.stderr and "started" not in run.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prefill_node_that_cannot_start_the_engine_refuses_the_pull_naming_it(tmp_path, engine):
    """P advertises an engine whose package is there but does not load (a path entry shadows it);
    D asks to pull over it: P refuses at the handshake, naming the engine and why, and D (its
    failure policy `fail`) answers a clean 502 saying so, at once, never a hang; no block stays
    used on D."""
    if transport_class(engine).unavailable():
        pytest.skip(f"{engine} transport unavailable: {transport_class(engine).unavailable()}")
    shadow = tmp_path / "shadow" / engine
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('libucp.so.0: cannot open shared object file')\n")
    p = pdserve_child(["serve", "--role", "prefill", *NODE], tmp_path, "p")
    p.start({**os.environ, "PYTHONPATH": str(tmp_path / "shadow")})
    wait_ready(p)
    d = start_pdserve(["serve", "--role", "decode", "--kv-transport", engine, "--kv-load-failure-policy", "fail",
                       *NODE], tmp_path, "d")
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        r = httpx.post(p.url + "/v1/completions", json={**body, "max_tokens": 1,
                                                         "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
        params = r.json()["kv_transfer_params"]
        assert engine in params["remote_transports"]  # the package is there: P advertises it
        start = time.monotonic()
        r = httpx.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
        assert r.status_code == 502 and time.monotonic() - start < 30, r.text
        message = r.json()["error"]["message"]
        assert f"KV transport '{engine}' cannot start on this node" in message and "libucp.so.0" in message
        assert metric(d.url, "pdserve:kv_transfers_failed_total") == 1
        assert wait_for_metric(d.url, "pdserve:kv_blocks_used", 0) == 0
    finally:
        d.stop()
        p.stop()
