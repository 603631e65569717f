"""Several hosts on one machine, for multi-host tests and benchmarks: network namespaces on a bridge.

Each `Host` is a network namespace with one address from 198.18.0.0/24 (the benchmarking range,
RFC 2544) on a veth pair whose other end sits on a bridge in this (the root) namespace, which
holds 198.18.0.254. This process reaches every host, the hosts reach each other, and nothing is
routed anywhere else: the namespaces have no default route and nothing forwards. Everything made
is deleted on exit, and every process left in a namespace killed first.

Needs root (CAP_NET_ADMIN) and iproute2's `ip`; `why_not()` says what is missing where they are not.

`RayOnHosts` starts a Ray cluster over them: the head on the first host, a worker on each other.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.models.locate import cache_root

NET = "198.18.0"
BRIDGE_HOST = 254  # this namespace's address on the bridge


def why_not() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    probe = f"pdserve-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    ns: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


@dataclass
class Hosts:
    """`count` hosts; a context manager that makes them and deletes them."""

    count: int
    tag: str = field(default_factory=lambda: str(os.getpid()))
    hosts: list[Host] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"pdbr{self.tag}"[:15]

    def _veth(self, i: int, end: str) -> str:
        """Host i's veth end: "o" on the bridge, "i" in its namespace (15 characters at most)."""
        return f"pdv{self.tag}{end}{i}"[:15]

    def __enter__(self) -> list[Host]:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{NET}.{BRIDGE_HOST}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                host = Host(f"pdserve-{self.tag}-{i}", f"{NET}.{i + 1}")
                _ip("netns", "add", host.ns)
                self.hosts.append(host)
                outer, inner = self._veth(i, "o"), self._veth(i, "i")
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", host.ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", inner)
                _ip("-n", host.ns, "link", "set", inner, "up")
                _ip("-n", host.ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self.hosts

    def __exit__(self, *exc_info: object) -> None:
        for i, host in enumerate(self.hosts):
            kill_all(host)
            # Both ends of the veth pair go now, not when the kernel gets round to freeing the namespace.
            with suppress(subprocess.CalledProcessError):
                _ip("link", "del", self._veth(i, "o"))
            with suppress(subprocess.CalledProcessError):
                _ip("netns", "del", host.ns)
        with suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)
        self.hosts = []


def kill_all(host: Host, grace_s: float = 5.0) -> None:
    """SIGTERM to every process in the host's namespace, then SIGKILL to what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = host.pids()
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.1)


class RayOnHosts:
    """A Ray cluster over the hosts: the head on the first, a worker on each other, `cpus` logical
    CPUs each. A context manager; on exit every Ray process in the namespaces is stopped.

    Its processes, and the drivers that join it, run with `env`: a HOME and a Ray temp dir
    ($RAY_TMPDIR) of their own, both removed on exit. So what other Ray clusters of this machine left
    in ~/.ray (an auth token) does not reach them, and what they leave (the head's address in
    ray_current_cluster, sessions, logs) reaches no later command: that address is gone with the
    namespaces, and a later `pdserve up --ray auto` must not find it."""

    def __init__(self, hosts: list[Host], cpus: int, port: int = 6379, object_store_bytes: int = 100 * 2**20) -> None:
        self.hosts, self.cpus, self.port, self.store = hosts, cpus, port, object_store_bytes
        self.ray = str(Path(sys.executable).with_name("ray"))
        # Short: Ray's unix sockets live under the temp dir (108 bytes a path at most).
        self.home = tempfile.mkdtemp(prefix="pdr", dir="/tmp")
        # pdserve's cache (converted models, built kernels) stays where it is.
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "HOME": self.home,
                    "RAY_TMPDIR": self.home, "PDSERVE_CACHE_DIR": str(cache_root())}

    @property
    def address(self) -> str:
        return f"{self.hosts[0].address}:{self.port}"

    def _start(self, host: Host, *args: str) -> None:
        common = ["--node-ip-address", host.address, "--num-cpus", str(self.cpus), "--object-store-memory",
                  str(self.store), "--disable-usage-stats"]
        done = host.run([self.ray, "start", *args, *common], capture_output=True, text=True, timeout=180, env=self.env)
        if done.returncode != 0:
            raise RuntimeError(f"ray start on {host.address} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def __enter__(self) -> RayOnHosts:
        try:
            self._start(self.hosts[0], "--head", "--port", str(self.port), "--include-dashboard=false")
            for host in self.hosts[1:]:
                self._start(host, "--address", self.address)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        for host in reversed(self.hosts):
            kill_all(host)
        shutil.rmtree(self.home, ignore_errors=True)
