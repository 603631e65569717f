"""Several hosts on one machine, for multi-host tests and benchmarks: network namespaces on a bridge.

Each `Host` is a network namespace with one address from a /24 of 198.18.0.0/15 (the benchmarking
range, RFC 2544) on a veth pair whose other end sits on a bridge in this (the root) namespace, which
holds the subnet's .254. This process reaches every host, the hosts reach each other, and nothing is
routed anywhere else: the namespaces have no default route and nothing forwards. The /24 is one no
address or route of this machine touches (another run's bridge, a network that uses the range); a
policy rule looks it up in the main table ahead of the machine's own rules; and once made, this
namespace's route to every host is checked to go through the bridge (a host's address that led off
the machine would send the tests' traffic there) and each host to answer a TCP connection (a
firewall fails at once, by name). Everything made is deleted on exit, and every process left in a
namespace killed first. What a killed run could not delete (its pid is gone) the next run deletes
before it makes its own (`remove_stale`).

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
from ipaddress import IPv4Network, ip_network
from pathlib import Path

from pdserve.models.locate import cache_root

RANGE = IPv4Network("198.18.0.0/15")
BRIDGE_HOST = 254  # this namespace's address on the bridge
RULE_PREF = 99  # the hosts' policy rule: before the machine's own (32766 is the main table's)
# Listens on (argv[1], a free port), prints the port, answers the first connection "hi" and exits.
ANSWER_ONCE = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
server.settimeout(30)
conn, _ = server.accept()
conn.sendall(b"hi")
conn.close()
"""


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


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def taken_networks() -> list[IPv4Network]:
    """The IPv4 networks this namespace's addresses and routes (every table; default routes aside) cover."""
    taken = []
    for line in _ip("-4", "-o", "addr", "show").splitlines():  # "2: eth0    inet 10.0.0.2/24 brd ..."
        taken.append(ip_network(line.split()[3], strict=False))
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        words = line.split()
        if words and words[0] in ("broadcast", "local", "unicast", "anycast", "multicast", "blackhole", "unreachable",
                                     "prohibit", "throw", "nat"):
            words = words[1:]
        if words and words[0] != "default":
            with suppress(ValueError):
                taken.append(ip_network(words[0], strict=False))
    return taken


def free_subnet(start: int | None = None) -> IPv4Network:
    """A /24 of 198.18.0.0/15 that no address or route here overlaps, searched from `start` (default:
    from this process's pid, so that runs at the same time start apart)."""
    subnets = list(RANGE.subnets(new_prefix=24))
    taken = taken_networks()
    first = os.getpid() if start is None else start
    for i in range(len(subnets)):
        subnet = subnets[(first + i) % len(subnets)]
        # A route wider than the range (a /8 over it) is overridden by the bridge's /24; one as narrow is not.
        if not any(subnet.overlaps(net) and net.prefixlen >= RANGE.prefixlen for net in taken):
            return subnet
    raise RuntimeError(f"every /24 of {RANGE} is taken by this machine's addresses or routes")


def _pid_alive(pid: int) -> bool:
    """A process with this pid runs (a zombie, killed but not yet waited for, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # "pid (comm) state ...": comm may hold spaces


def _stale_tag(name: str, prefix: str) -> str | None:
    """The pid tag of `name` ("<prefix><pid>...") where that process is gone, else None."""
    tag = name.removeprefix(prefix).split("-")[0]
    return tag if name.startswith(prefix) and tag.isdigit() and not _pid_alive(int(tag)) else None


def remove_stale() -> list[str]:
    """Deletes what a run killed before its exit (SIGKILL, a machine's session ending) left: its
    namespaces (their processes killed first), its bridge (the veth ends go with it) and the policy
    rule to its subnet. A run's things carry its pid; only those whose process is gone are touched.
    Returns what it deleted."""
    removed = []
    for line in _ip("netns", "list").splitlines():  # "pdserve-123-0 (id: 1)"
        ns = line.split()[0] if line.split() else ""
        if _stale_tag(ns, "pdserve-") is not None:
            kill_all(Host(ns, ""))
            with suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
                removed.append(f"namespace {ns}")
    for line in _ip("-4", "-o", "addr", "show").splitlines():  # "9: pdbr123    inet 198.18.5.254/24 ..."
        words = line.split()
        if _stale_tag(words[1], "pdbr") is None:
            continue
        subnet = ip_network(words[3], strict=False)
        with suppress(subprocess.CalledProcessError):
            _ip("link", "del", words[1])
            removed.append(f"bridge {words[1]}")
        with suppress(subprocess.CalledProcessError):
            _ip("rule", "del", "to", str(subnet), "lookup", "main", "pref", str(RULE_PREF))
            removed.append(f"rule to {subnet}")
    return removed


@dataclass
class Host:
    ns: str
    address: str
    dev: str = ""  # its end of the veth pair to the bridge

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def set_link(self, up: bool) -> None:
        """Take the host's link to the bridge down (its peers' packets go nowhere) or back up."""
        _ip("-n", self.ns, "link", "set", self.dev, "up" if up else "down")

    def cap_rate(self, rate: str | None) -> None:
        """Cap what the host sends over its link (tc's token bucket, e.g. "100mbit"); None lifts it."""
        if rate is None:
            subprocess.run(["tc", "-n", self.ns, "qdisc", "del", "dev", self.dev, "root"], capture_output=True)
        else:
            subprocess.run(["tc", "-n", self.ns, "qdisc", "replace", "dev", self.dev, "root", "tbf", "rate", rate,
                            "burst", "256kb", "latency", "500ms"], check=True, capture_output=True, text=True)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def reached(self, from_ns: str | None = None, timeout_s: float = 10.0) -> str:
        """Why a TCP connection from this namespace (or from namespace `from_ns`) to the host fails, or ""."""
        server = self.popen([sys.executable, "-c", ANSWER_ONCE, self.address], stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            client = [sys.executable, "-c", "import socket, sys; s = socket.create_connection((sys.argv[1], "
                      f"int(sys.argv[2])), timeout={timeout_s}); print(s.recv(2).decode())", self.address, str(port)]
            if from_ns:
                client = ["ip", "netns", "exec", from_ns, *client]
            done = subprocess.run(client, capture_output=True, text=True, timeout=timeout_s + 20)
            return "" if done.stdout.strip() == "hi" else (done.stderr.strip().splitlines() or ["no answer"])[-1]
        finally:
            server.kill()
            server.wait()

    def check_reached(self) -> None:
        if why := self.reached():
            raise RuntimeError(f"this namespace does not reach the test host {self.address} over TCP ({why}): "
                               "a firewall of this machine's?")

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


@dataclass
class Hosts:
    """`count` hosts; a context manager that makes them and deletes them."""

    count: int
    tag: str = field(default_factory=lambda: str(os.getpid()))
    hosts: list[Host] = field(default_factory=list)
    subnet: IPv4Network | None = None  # chosen on entry (free_subnet)
    rule_added: bool = False

    @property
    def bridge(self) -> str:
        return f"pdbr{self.tag}"[:15]

    def _veth(self, i: int, end: str) -> str:
        """Host i's veth end: "o" on the bridge, "i" in its namespace (15 characters at most)."""
        return f"pdv{self.tag}{end}{i}"[:15]

    def __enter__(self) -> list[Host]:
        remove_stale()
        self.subnet = self.subnet or free_subnet()
        address = lambda i: str(self.subnet[i])  # noqa: E731
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{address(BRIDGE_HOST)}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                host = Host(f"pdserve-{self.tag}-{i}", address(i + 1), self._veth(i, "i"))
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
            # Ahead of any policy rule of the machine's own (a VPN's or a proxy's table): the hosts'
            # subnet is looked up in the main table, where the bridge's route is. Removed on exit.
            _ip("rule", "add", "to", str(self.subnet), "lookup", "main", "pref", str(RULE_PREF))
            self.rule_added = True
            self._check_routes()
            for host in self.hosts:
                host.check_reached()
        except BaseException:
            self.__exit__()
            raise
        return self.hosts

    def _check_routes(self) -> None:
        """This namespace's route to every host goes through the bridge (not off the machine: a policy
        rule or a route of the machine's own may win over the bridge's)."""
        for host in self.hosts:
            got = subprocess.run(["ip", "-4", "route", "get", host.address], capture_output=True, text=True)
            route = (got.stdout + got.stderr).strip()
            if got.returncode != 0 or f" dev {self.bridge} " not in f" {route} ":
                raise RuntimeError(f"{host.address} is not reached through the test bridge {self.bridge} here "
                                   f"(ip route get: {route}); refusing to send test traffic there")

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
        if self.rule_added:
            with suppress(subprocess.CalledProcessError):
                _ip("rule", "del", "to", str(self.subnet), "lookup", "main", "pref", str(RULE_PREF))
            self.rule_added = False
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


# The namespaces share this machine's memory: NIXL's UCX would reach the other "host" through shared
# memory (faster than the link), which separate hosts cannot. Processes standing in for another host's
# run with this, so bytes between the hosts cross the network as they would there.
NETWORK_ONLY = {"UCX_TLS": "tcp"}


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
                    "RAY_TMPDIR": self.home, "PDSERVE_CACHE_DIR": str(cache_root()), **NETWORK_ONLY}

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
