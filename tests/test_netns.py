"""The multi-host tests' hosts (pdserve/testing/netns.py): each set on a /24 of 198.18.0.0/15 that
nothing of this machine uses, reached through its own bridge and nowhere else, gone on exit."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from ipaddress import IPv4Network

import pytest

from pdserve.testing.netns import RANGE, Hosts, free_subnet, why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"needs network namespaces: {why_not()}")

# Listens in a namespace on (argv[1], a free port), prints the port, answers one connection with "hi".
ANSWER_ONCE = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.sendall(b"hi")
conn.close()
"""


@contextmanager
def blackhole(network: str):
    """A route that swallows `network` here, as a network of the machine's own in the range would take it."""
    subprocess.run(["ip", "route", "add", "blackhole", network], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "route", "del", "blackhole", network], check=True)


def reached_from_here(host, client_ns: str | None = None) -> bool:
    server = host.popen([sys.executable, "-c", ANSWER_ONCE, host.address], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        connect = f"import socket; print(socket.create_connection(('{host.address}', {port}), timeout=5).recv(2))"
        argv = [sys.executable, "-c", connect]
        if client_ns:
            argv = ["ip", "netns", "exec", client_ns, *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip() == "b'hi'"
    finally:
        server.kill()
        server.wait()


def leftovers(tag: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in (names + links).splitlines() if f"pdserve-{tag}-" in line or f"pdbr{tag}" in line]


def test_a_subnet_the_machine_routes_is_skipped():
    first = free_subnet(start=0)
    assert first.subnet_of(RANGE) and first.prefixlen == 24
    with blackhole(str(first)):
        second = free_subnet(start=0)
    assert second != first and second.subnet_of(RANGE)
    assert free_subnet(start=0) == first  # free again once the route is gone


def test_two_sets_of_hosts_at_once_take_different_subnets_each_reached_only_through_its_bridge():
    with Hosts(2, tag="t1") as a, Hosts(2, tag="t2") as b:
        net = lambda hosts: IPv4Network(f"{hosts[0].address}/24", strict=False)  # noqa: E731
        assert net(a) != net(b) and net(a).subnet_of(RANGE) and net(b).subnet_of(RANGE)
        assert reached_from_here(a[1]) and reached_from_here(b[0])
        assert reached_from_here(a[1], client_ns=a[0].ns)  # the hosts reach each other
    assert leftovers("t1") == [] and leftovers("t2") == []


def test_hosts_whose_address_would_leave_through_another_route_are_refused_and_removed():
    subnet = free_subnet(start=3)
    with blackhole(f"{subnet[1]}/32"):  # narrower than the bridge's /24: it wins for host 0
        with pytest.raises(RuntimeError, match="not reached through the test bridge"):
            with Hosts(2, tag="t3", subnet=subnet):
                pass
    assert leftovers("t3") == []
