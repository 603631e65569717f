"""`pdserve up --ray` across hosts: two network namespaces on a bridge (pdserve/benchmarks/netns.py),
a Ray head in one and a Ray worker in the other, P on one host and D on the other. PD output equals
a single node's; a decode node's actor killed mid-traffic: the proxy retries on the other decode
node, Ray restarts the actor, it comes back into rotation, and every node's blocks return to 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import MODEL, NODE, metric, wait_for_metric

from pdserve.benchmarks.netns import Hosts, RayOnHosts, why_not
from pdserve.kv.transport.shm import on_this_host

try:
    import ray  # noqa: F401
    RAY_MISSING = None
except ImportError:
    RAY_MISSING = "Ray is not installed (pip install 'pdserve[ray]')"

PROMPTS = ["The three primary colors are", "A list of prime numbers: 2, 3, 5, 7,",
           "Once upon a time, in a small village by the sea,", "Q: What is the boiling point of water?\nA:"]


def test_shm_only_reaches_peers_that_advertise_an_address_of_this_host():
    assert on_this_host("127.0.0.1") and on_this_host("localhost")
    assert not on_this_host("198.18.255.253")  # an address no interface here has


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = RAY_MISSING or why_not()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces and Ray: {reason}")
    log = tmp_path_factory.mktemp("ray") / "up.log"
    with Hosts(2) as hosts, RayOnHosts(hosts, cpus=2):
        head, worker = hosts
        up = head.popen([sys.executable, "-m", "pdserve.cli", "up", "--ray", f"{head.address}:6379",
                         "--prefill", "1", "--decode", "2", "--placement", "spread", "--host", head.address,
                         "--port", "8000", "--log-level", "info", *NODE],
                        stdout=open(log, "w"), stderr=subprocess.STDOUT, env=os.environ)
        url = f"http://{head.address}:8000"
        try:
            wait_ready(url, up, log, 300)
            yield url, hosts, log
        finally:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()


def wait_ready(url: str, up: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert up.poll() is None, f"pdserve up --ray exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"pdserve up --ray not ready in {timeout_s} s: {log.read_text()[-3000:]}")


def nodes(url: str) -> list[dict]:
    return httpx.get(url + "/v1/nodes", timeout=5).json()["nodes"]


def complete(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_pd_across_hosts_equals_one_node(cluster, fp32_node):
    url, hosts, _ = cluster
    listed = nodes(url)
    assert len(listed) == 3 and all(n["healthy"] for n in listed)
    host_of = {n["url"]: re.match(r"http://([\d.]+):", n["url"]).group(1) for n in listed}
    assert set(host_of.values()) == {h.address for h in hosts}  # spread over both hosts
    [prefill_host] = [host_of[n["url"]] for n in listed if n["role"] == "prefill"]
    assert any(host_of[n["url"]] != prefill_host for n in listed if n["role"] == "decode")  # KV crosses hosts
    expected = [complete(fp32_node.url, p) for p in PROMPTS]
    for _ in range(2):  # both decode nodes (round robin): one shares P's host, one does not
        assert [complete(url, p) for p in PROMPTS] == expected
    received = sum(metric(n["url"], "pdserve:kv_transfer_bytes_total", 'direction="received"') for n in listed
                   if n["role"] == "decode")
    assert received > 0


def test_a_killed_actor_is_retried_around_restarted_and_back(cluster):
    url, hosts, log = cluster
    decoders = [n["url"] for n in nodes(url) if n["role"] == "decode"]
    victim = decoders[0]
    port = victim.rsplit(":", 1)[1]
    node_pid = next(pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                    if f"--port\x00{port}\x00" in _cmdline(pid) and "serve" in _cmdline(pid))
    actor_pid = int(Path(f"/proc/{node_pid}/stat").read_text().split(")")[1].split()[1])  # its parent: the actor
    os.kill(actor_pid, signal.SIGKILL)  # the actor dies; its node dies with it
    for p in PROMPTS * 2:  # the proxy retries each on the other decode node
        assert complete(url, p)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        listed = nodes(url)
        back = [n for n in listed if n["role"] == "decode" and n["healthy"]]
        if len(back) == 2 and victim not in [n["url"] for n in back]:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the restarted decode node is not back: {nodes(url)}; log: {log.read_text()[-3000:]}")
    for p in PROMPTS:
        assert complete(url, p)
    for n in nodes(url):
        assert wait_for_metric(n["url"], "pdserve:kv_blocks_used", 0, timeout=30) == 0, n


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""
