"""Test-only: where the test suite's Python processes connect.

The suite may reach this machine only: loopback, its own interface addresses, and the network
namespaces its multi-host tests make (198.18.0.0/15). This guard checks every socket connect()
against that, through an audit hook (Python's `socket.connect` event, raised before the call):
- a TCP connect (or any but UDP) elsewhere is refused before it is made (PermissionError), so
  nothing leaves the machine, and recorded as a violation;
- a UDP connect elsewhere is recorded as a route lookup and let through: it sends nothing (Ray
  finds its node's address by connecting a UDP socket toward 8.8.8.8 and reading the source
  address the kernel picked).

conftest.py installs it in the pytest process and puts this folder on PYTHONPATH, so that every
Python child (nodes, proxies, `pdserve up`, Ray's workers, processes in the namespaces) loads it
through sitecustomize.py. Each connect is one JSON line in $PDSERVE_CONNECT_LOG; the last test
(tests/test_footprint.py) reads them. Not seen: connects made in C++ (Ray's gRPC core), and children
started with an environment of their own (without PYTHONPATH).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys

LOG_ENV = "PDSERVE_CONNECT_LOG"
ALLOWED_NETS = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128", "198.18.0.0/15")]
_local: dict[str, bool] = {}  # address -> whether it is one of this machine's (namespace's) own


def is_allowed(ip: str) -> bool:
    """Loopback, the tests' namespace range, the unspecified address (this host), or an address a
    socket here can bind (one of this machine's interfaces)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if addr.is_unspecified or any(addr in net for net in ALLOWED_NETS):
        return True
    if ip not in _local:
        try:
            with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((ip, 0))
            _local[ip] = True
        except OSError:
            _local[ip] = False
    return _local[ip]


def _targets(host: str, port: int) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host.split("%")[0]))]
    except ValueError:  # a name: every address it resolves to must be allowed
        try:
            return sorted({info[4][0] for info in socket.getaddrinfo(host, port)})
        except OSError:
            return []  # unresolvable: the connect fails on its own


def _hook(event: str, args: tuple) -> None:
    if event != "socket.connect":
        return
    sock, address = args
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
        return  # unix sockets and the like stay on the machine
    host, port = address[0], address[1]
    udp = sock.type == socket.SOCK_DGRAM
    bad = [ip for ip in _targets(str(host), port) if not is_allowed(ip)]
    kind = ("route lookup" if udp else "violation") if bad else "local"
    _record({"pid": os.getpid(), "argv": sys.argv[:3], "host": str(host), "port": port,
             "type": "udp" if udp else "tcp", "kind": kind})
    if bad and not udp:
        raise PermissionError(f"test connect guard: {host}:{port} is not on this machine nor in 198.18.0.0/15")


def _record(entry: dict) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps(entry) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # one write a line: no interleaving
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def install() -> None:
    if not getattr(sys, "_pdserve_connect_guard", False):
        sys._pdserve_connect_guard = True
        sys.addaudithook(_hook)


def read_log(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def shm_pools() -> list[str]:
    """pdserve's shared KV pools now in /dev/shm (imported here, not at the top: every process of
    the session loads this guard, most without pdserve)."""
    from pdserve.procinfo import POOL_PREFIX, SHM_DIR

    return sorted(path.name for path in SHM_DIR.glob(f"{POOL_PREFIX}*")) if SHM_DIR.is_dir() else []


def footprint() -> dict[str, list[str] | None]:
    """What a Ray run or a namespace leaves for later commands to find: Ray's default temp dir
    (/tmp/ray: ray_current_cluster, sessions), ~/.ray (auth tokens) and the network namespaces."""
    def listing(path: str) -> list[str] | None:
        return sorted(os.listdir(path)) if os.path.isdir(path) else None

    import subprocess

    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return {"/tmp/ray": listing("/tmp/ray"), "~/.ray": listing(os.path.expanduser("~/.ray")),
            "ip netns list": sorted(line for line in netns if line.strip())}
