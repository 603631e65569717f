"""The proxy's colocated mode: load balancing over --role both nodes (the study's baseline)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
from servers import metric, start_pdserve
from test_pd_pull import MODEL, NODE, PROMPTS, client

from pdserve.benchmarks import gap_views, host_load


def test_colocated_proxy_balances_and_keeps_outputs(tmp_path):
    nodes = [start_pdserve(["serve", "--role", "both", *NODE], tmp_path, f"both{i}") for i in range(2)]
    proxy = start_pdserve(["proxy", "--mode", "colocated", "--node", *[n.url for n in nodes]], tmp_path, "proxy")
    try:
        expected = [client(nodes[0].url).completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
                    .choices[0].text for p in PROMPTS[:4]]
        before = [metric(n.url, "pdserve:request_success_total", 'finish_reason="length"') for n in nodes]
        c = client(proxy.url)
        got = [c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
               for p in PROMPTS[:4]]
        assert got == expected
        served = [metric(n.url, "pdserve:request_success_total", 'finish_reason="length"') - b
                  for n, b in zip(nodes, before)]
        assert served == [2, 2]  # round robin
        chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert httpx.get(proxy.url + "/health").json()["mode"] == "colocated"
        # The proxy and the nodes serve on uvloop and httptools (pdserve's dependencies): the proxy
        # relays every streamed token, and their C loop and parser cost it 10-15 % less CPU a token.
        for proc in (proxy, *nodes):
            maps = open(f"/proc/{proc.proc.pid}/maps").read()
            assert "uvloop/loop." in maps and "httptools/parser/" in maps, proc.name

        # A stream's longest gap, as the engine emitted, the node sent and the proxy relayed it
        # (benchmarks/gap_views.py), and what the stream cost the host (benchmarks/host_load.py), from
        # one read of the pages before and after.
        pages = gap_views.Pages.fetch(proxy.url)
        before, load_before = gap_views.read(pages), host_load.read(os.getpid(), pages)
        stream = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
        assert sum(bool(ch.choices and ch.choices[0].text) for ch in stream) == 48
        deadline = time.monotonic() + 10  # the proxy's relay ends as the stream closes, maybe after the last read
        while True:
            pages = gap_views.Pages.fetch(proxy.url)
            if (views := gap_views.shares(before, gap_views.read(pages), [30.0, 70.0]))["proxy"]["requests"] >= 1:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        load = host_load.delta(load_before, host_load.read(os.getpid(), pages))
        assert sorted(load["decode"]) == sorted(n.url for n in nodes)
        # 48 tokens (enough proxy work to pass a 10-ms CPU tick on uvloop): the first from the prefill
        # step, then 47 decode-only steps of one sequence
        assert sum(c["decode_steps"] for c in load["decode"].values()) == 47
        assert sum(c["decode_step_seqs"] for c in load["decode"].values()) == 47
        assert load["cpu_s"]["proxy"] > 0 and load["cpu_s"]["node"] > 0 and load["wall_s"] > 0
        # The serving node's steps: its engine thread's CPU time in them is within their wall time
        busy = max(load["busy"].values(), key=lambda c: c["engine_busy_seconds"])
        assert 0 < busy["engine_busy_cpu_seconds"] <= busy["engine_busy_seconds"] + 1e-3
        assert all(-0.01 < share < 1 for share in host_load.off_cpu_shares(load).values())
        assert views["engine"]["requests"] == views["server"]["requests"] == views["proxy"]["requests"] == 1
        assert views["client"] == {"requests": 2, "within_ms": {"40": 0.5, "60": 0.5, "80": 1.0, "100": 1.0, "150": 1.0,
                                                                "200": 1.0, "300": 1.0, "500": 1.0, "750": 1.0, "1000": 1.0}}
        for view in ("engine", "server", "proxy"):  # an idle node's 48 tokens: every gap well under a second
            within = list(views[view]["within_ms"].values())
            assert within == sorted(within) and within[-1] == 1.0, (view, within)
    finally:
        for proc in (proxy, *nodes):
            proc.stop()


def test_the_proxy_and_the_clis_checks_start_without_torch():
    """Importing torch costs ~1.5 s a process here: the proxy, the CLI and the workloads do without it
    (every CLI test and every proxy start paid it before)."""
    code = ("import sys, pdserve, pdserve.cli, pdserve.proxy.app, pdserve.workload; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_proxy_flags_must_fit_the_mode():
    for args, message in ((["--mode", "colocated"], "colocated mode needs at least one colocated node (--node"),
                          (["--mode", "pull", "--prefill", "http://x:1"], "needs at least one prefill and one decode"),
                          (["--mode", "colocated", "--node", "http://a:1", "--decode", "http://b:1"],
                           "colocated mode takes --node URLs"),
                          (["--mode", "pull", "--node", "http://a:1"], "pull mode takes --prefill / --decode URLs, not --node"),
                          (["--prefill", "localhost:1", "--decode", "http://b:1"], "is not an http(s)://host:port URL"),
                          (["--prefill", "http://a:1", "--decode", "http://a:1"], "already a node"),
                          (["--nodes-file", "/nonexistent.json"], "nodes file /nonexistent.json"),
                          (["--mode", "auto", "--node", "http://a:1"], "auto mode needs --profile"),
                          (["--mode", "auto", "--prefill", "http://a:1"], "auto mode needs at least one decode"),
                          (["--mode", "auto", "--prefill", "http://a:1", "--node", "http://b:1"],
                           "cannot use prefill nodes without a decode or kv_both node"),
                          (["--mode", "pull", "--kv-both", "http://a:1", "--decode", "http://b:1"],
                           "pull mode takes --prefill / --decode URLs, not --kv-both"),
                          (["--mode", "auto", "--node", "http://a:1", "--profile", "/nonexistent.json"],
                           "--profile /nonexistent.json: No such file"),
                          (["--mode", "mixed", "--node", "http://a:1"], "invalid choice: 'mixed'")):
        proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "proxy", *args], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
