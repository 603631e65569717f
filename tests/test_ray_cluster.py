"""`pdserve up --ray` across hosts: two network namespaces on a bridge (pdserve/testing/netns.py),
a Ray head in one and a Ray worker in the other, P on one host and D on the other. PD output equals
a single node's; a decode node's actor killed mid-traffic: the proxy retries on the other decode
node, Ray restarts the actor, it comes back into rotation, and every node's blocks return to 0."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
from servers import MODEL, NODE, free_port, metric, wait_for_metric

from pdserve.testing.netns import Host, Hosts, RayOnHosts, why_not
from pdserve.kv.transport import transport_class
from pdserve.kv.transport.shm import on_this_host
from pdserve.models.locate import cache_root

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
def ray_hosts():
    reason = RAY_MISSING or why_not()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces and Ray: {reason}")
    with Hosts(2) as hosts, RayOnHosts(hosts, cpus=4) as ray_cluster:  # both clusters of the tests fit
        yield hosts, ray_cluster


@contextmanager
def up_on(head: Host, ray_cluster: RayOnHosts, log: Path, port: int, *args: str):
    """`pdserve up --ray` on the head's host: its proxy's URL once ready, and its pid. Ctrl-C at the end."""
    up = head.popen([sys.executable, "-m", "pdserve.cli", "up", "--ray", ray_cluster.address, "--host", head.address,
                     "--port", str(port), "--log-level", "info", *args, *NODE],
                    stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ray_cluster.env)
    url = f"http://{head.address}:{port}"
    try:
        wait_ready(url, up, log, 300)
        yield url, up.pid
    finally:
        up.send_signal(signal.SIGINT)
        try:
            assert up.wait(60) == 0, log_tail(log)
        except subprocess.TimeoutExpired:
            up.kill()
            raise


@pytest.fixture(scope="module")
def cluster(ray_hosts, tmp_path_factory):
    """1P2D, pull, spread over the two hosts."""
    hosts, ray_cluster = ray_hosts
    log = tmp_path_factory.mktemp("ray") / "up.log"
    with up_on(hosts[0], ray_cluster, log, 8000, "--prefill", "1", "--decode", "2", "--ray-placement", "spread") as (url, _):
        yield url, hosts, log


def wait_ready(url: str, up: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline, last = time.monotonic() + timeout_s, "no answer yet"
    while time.monotonic() < deadline:
        assert up.poll() is None, f"pdserve up --ray exited: {log_tail(log)}"
        try:
            answer = httpx.get(url + "/health", timeout=2)
            if answer.status_code == 200:
                return
            last = f"HTTP {answer.status_code}: {answer.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise TimeoutError(f"pdserve up --ray not ready in {timeout_s} s (its /health, last: {last}): {log_tail(log)}")


def log_tail(log: Path, chars: int = 3000) -> str:
    """The end of `pdserve up`'s log without the nodes' HTTP access lines (Ray forwards them: the
    health checks alone would fill it)."""
    kept = [line for line in log.read_text().splitlines() if ' HTTP/1.1" ' not in line]
    return "\n".join(kept)[-chars:]


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
    node_pid = next(pid for pid in _pids() if f"--port\x00{port}\x00" in _cmdline(pid) and "serve" in _cmdline(pid))
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
        raise AssertionError(f"the restarted decode node is not back: {nodes(url)}; log: {log_tail(log)}")
    for p in PROMPTS:
        assert complete(url, p)
    for n in nodes(url):
        assert wait_for_metric(n["url"], "pdserve:kv_blocks_used", 0, timeout=30) == 0, n


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


# Each transfer engine crosses the hosts in one mode (Mooncake writing, NIXL reading: a READ needs
# the passive side's progress thread); both modes of each run on one host in test_pd_transfer_engines.
@pytest.mark.parametrize("mode", ["push", "auto", "push-mooncake", "pull-nixl"])
def test_push_and_auto_across_hosts_equal_one_node_and_leave_nothing_behind(ray_hosts, fp32_node, tmp_path, mode):
    """Push: D (on the other host) announces its blocks to the proxy, P writes each layer into them.
    Auto: the proxy places each request (docs/results/profile.json). Push over the Mooncake Transfer
    Engine (its tcp protocol between the hosts) and pull over NIXL (UCX held to tcp), each skipped
    where it is not installed. After Ctrl-C no actor and no placement group of pdserve's is left in the Ray cluster."""
    hosts, ray_cluster = ray_hosts
    mode, _, transport = mode.partition("-")
    if transport and transport_class(transport).unavailable():
        pytest.skip(f"{transport} transport unavailable: {transport_class(transport).unavailable()}")
    extra = ["--profile", str(PROFILE)] if mode == "auto" else []
    extra += ["--kv-transport", transport] if transport else []
    with up_on(hosts[0], ray_cluster, tmp_path / "up.log", 8001, "--mode", mode, "--prefill", "1", "--decode", "1",
               "--placement", "spread", *extra) as (url, pid):  # issue 17's spelling of --ray-placement
        listed = nodes(url)
        assert len({re.match(r"http://([\d.]+):", n["url"]).group(1) for n in listed}) == 2  # one host each
        assert [complete(url, p) for p in PROMPTS] == [complete(fp32_node.url, p) for p in PROMPTS]
        if transport:  # every byte crossed over it, counted on both ends
            for node in listed:
                direction = "received" if node["role"] == "decode" else "sent"
                assert metric(node["url"], "pdserve:kv_transfer_bytes_total",
                              f'direction="{direction}",transport="{transport}"') > 0, (node, mode)
    left = hosts[0].run([sys.executable, "-c", LEFTOVERS, ray_cluster.address, f"-{pid}"], capture_output=True,
                        text=True, timeout=120, env=ray_cluster.env)
    assert left.stdout.split()[-2:] == ["0", "0"], left.stdout + left.stderr


# One `pdserve up`'s actors still alive and placement groups not removed (their names end in its
# pid), as the Ray cluster's GCS knows them.
LEFTOVERS = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
mine = lambda name: (name or "").endswith(sys.argv[2])
actors = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD" and mine(a["Name"])]
groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED" and mine(g["name"])]
print(len(actors), len(groups))
"""
PROFILE = Path(__file__).parents[1] / "docs" / "results" / "profile.json"


def test_without_ray_up_says_how_to_get_it(tmp_path):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")  # as if not installed
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--ray"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert done.returncode == 2 and "pip install 'pdserve[ray]'" in done.stderr, done.stderr


def test_one_machine_ray_with_a_stale_record_starts_its_own_and_is_gone_after_ctrl_c(tmp_path, fp32_node, request):
    """`pdserve up --ray` (auto) where Ray's temp dir records a head that is not on this machine, as
    a deleted namespace's once was: it says the record is stale, never connects to that address,
    starts a cluster here and answers; Ctrl-C leaves no actor, no Ray. The recorded address is a
    listener in the other test host's namespace that counts the connections it accepts (without
    namespaces: no record, the rest as said)."""
    if RAY_MISSING:
        pytest.skip(RAY_MISSING)
    port = free_port()
    log = tmp_path / "up.log"
    # A Ray temp dir of its own: no other cluster of this machine is found (the namespaced one's head
    # answers from here too).
    ray_tmp = tempfile.mkdtemp(prefix="pdr", dir="/tmp")  # (and HOME: Ray leaves an auth token in ~/.ray)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp, "HOME": ray_tmp,
           "PDSERVE_CACHE_DIR": str(cache_root())}
    listener = None
    if why_not() is None:
        hosts, _ = request.getfixturevalue("ray_hosts")
        listener = hosts[1].popen([sys.executable, "-c", COUNT_CONNECTIONS, hosts[1].address],
                                  stdout=subprocess.PIPE, text=True)
        recorded = f"{hosts[1].address}:{int(listener.stdout.readline())}"
        os.makedirs(os.path.join(ray_tmp, "ray"))
        Path(ray_tmp, "ray", "ray_current_cluster").write_text(recorded)
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--ray", "auto", "--ray-placement", "pack",
                           "--port", str(port), *NODE], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, up, log, 300)
        text = log.read_text()
        assert "started a Ray cluster on this machine" in text
        if listener is not None:
            assert f"({recorded}) is not an address of this machine: stale" in text, text[-3000:]
        assert complete(url, PROMPTS[0]) == complete(fp32_node.url, PROMPTS[0])
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, log_tail(log)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if listener is not None:
            listener.terminate()
            accepted = listener.communicate(timeout=30)[0].split()
    if listener is not None:
        assert accepted == ["0"], f"the stale address was connected to: {accepted}"
    here = os.readlink("/proc/self/ns/net")  # (the namespaced cluster of the other tests may still run)
    assert not [pid for pid in _pids() if ("raylet" in _cmdline(pid) or "gcs_server" in _cmdline(pid))
                and _netns(pid) == here]


# Listens on argv[1] (a free port), prints the port, then on SIGTERM how many connections it accepted.
COUNT_CONNECTIONS = """
import signal, socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
server.settimeout(0.1)
stop, accepted = [], 0
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
while not stop:
    try:
        server.accept()[0].close()
        accepted += 1
    except (TimeoutError, InterruptedError):
        pass
print(accepted, flush=True)
"""


@pytest.mark.parametrize("answer", ["http", "nothing"])
def test_an_explicit_address_that_is_no_ray_cluster_fails_naming_it(tmp_path, answer):
    """`--ray HOST:PORT` where an HTTP server answers (as in the stale-address report: a 404 to Ray's
    gRPC, retried without end) or nothing listens: non-zero within 30 s, naming the address."""
    if RAY_MISSING:
        pytest.skip(RAY_MISSING)
    port = free_port()
    server = None
    if answer == "http":
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "HOME": str(tmp_path),
           "RAY_TMPDIR": str(tmp_path)}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--ray", f"127.0.0.1:{port}", *NODE],
                              capture_output=True, text=True, env=env, timeout=60)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    took = time.monotonic() - start
    assert done.returncode == 1 and took < 30, (took, done.stdout[-2000:], done.stderr[-2000:])
    assert f"no Ray cluster answers at 127.0.0.1:{port} (from --ray)" in done.stderr, done.stderr[-2000:]


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _netns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""
