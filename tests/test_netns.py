"""The multi-host tests' hosts (pdserve/testing/netns.py): each set on a /24 of 198.18.0.0/15 that
nothing of this machine uses, reached through its own bridge and nowhere else, gone on exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from ipaddress import IPv4Network

import pytest

from pdserve.testing.netns import RANGE, RULE_PREF, Hosts, free_subnet, remove_stale, why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"needs network namespaces: {why_not()}")


@contextmanager
def blackhole(network: str):
    """A route that swallows `network` here, as a network of the machine's own in the range would take it."""
    subprocess.run(["ip", "route", "add", "blackhole", network], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "route", "del", "blackhole", network], check=True)


def leftovers(tag: str, subnet: IPv4Network) -> list[str]:
    """What a set of hosts tagged `tag` (on `subnet`) left: namespaces, links, its policy rule."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    rules = subprocess.run(["ip", "rule"], capture_output=True, text=True).stdout
    return [line for line in (names + links).splitlines() if f"pdserve-{tag}-" in line or f"pdbr{tag}" in line] + \
        [line for line in rules.splitlines() if line.startswith(f"{RULE_PREF}:") and f"to {subnet} " in f"{line} "]


def test_a_subnet_the_machine_routes_is_skipped():
    first = free_subnet(start=0)
    assert first.subnet_of(RANGE) and first.prefixlen == 24
    with blackhole(str(first)):
        second = free_subnet(start=0)
    assert second != first and second.subnet_of(RANGE)
    assert free_subnet(start=0) == first  # free again once the route is gone


def test_two_sets_of_hosts_at_once_take_different_subnets_each_reached_only_through_its_bridge():
    with Hosts(2, tag="t1") as a, Hosts(2, tag="t2") as b:
        nets = [IPv4Network(f"{hosts[0].address}/24", strict=False) for hosts in (a, b)]
        assert nets[0] != nets[1] and all(net.subnet_of(RANGE) for net in nets)
        assert a[1].reached() == "" and b[0].reached() == ""
        assert a[1].reached(from_ns=a[0].ns) == ""  # the hosts reach each other
        assert b[0].reached(from_ns=a[0].ns, timeout_s=2) != ""  # not another set's
    assert leftovers("t1", nets[0]) == [] and leftovers("t2", nets[1]) == []


def test_hosts_whose_address_would_leave_through_another_route_are_refused_and_removed():
    subnet = free_subnet(start=3)
    with blackhole(f"{subnet[1]}/32"):  # narrower than the bridge's /24: it wins for host 0
        with pytest.raises(RuntimeError, match="not reached through the test bridge"):
            with Hosts(2, tag="t3", subnet=subnet):
                pass
    assert leftovers("t3", subnet) == []


def test_hosts_are_reached_past_a_policy_rule_that_sends_their_subnet_elsewhere():
    """As on a machine whose VPN or proxy looks everything up in a table of its own first."""
    subnet = free_subnet(start=5)
    subprocess.run(["ip", "route", "add", "blackhole", "default", "table", "4242"], check=True)
    subprocess.run(["ip", "rule", "add", "to", str(subnet), "lookup", "4242", "pref", "1000"], check=True)
    try:
        with Hosts(2, tag="t4", subnet=subnet) as hosts:
            assert hosts[0].reached() == "" and hosts[1].reached() == ""
    finally:
        subprocess.run(["ip", "rule", "del", "to", str(subnet), "lookup", "4242", "pref", "1000"], check=True)
        subprocess.run(["ip", "route", "del", "blackhole", "default", "table", "4242"], check=True)
    assert leftovers("t4", subnet) == []


KILLED_RUN = """
import sys, time
from pdserve.testing.netns import Hosts
hosts = Hosts(2).__enter__()
print(hosts[0].address, flush=True)
time.sleep(600)
"""


def test_what_a_killed_run_left_is_removed_by_the_next_and_a_live_runs_is_not():
    """A run SIGKILLed inside its hosts (a CI machine's session ending) leaves namespaces, a bridge
    and a policy rule; the next set of hosts deletes them first. A live process's set stays."""
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN], stdout=subprocess.PIPE, text=True)
    subnet = IPv4Network(f"{run.stdout.readline().strip()}/24", strict=False)
    tag = str(run.pid)
    try:
        with Hosts(1, tag="t5") as live:  # a live run's (this process is alive; the tag is not a pid)
            # 2 namespaces, the bridge, its 2 veth ends ("master pdbr<pid>"), the rule
            assert len(leftovers(tag, subnet)) == 6
            os.kill(run.pid, signal.SIGKILL)
            run.wait()
            assert len(leftovers(tag, subnet)) == 6
            # Tagged with this (live) process's pid, on a subnet chosen while the killed run's still has
            # its bridge: the rule to the killed run's subnet seen next can only be a leftover of that run.
            with Hosts(1, subnet=free_subnet()) as mine:
                assert leftovers(tag, subnet) == []
                assert remove_stale() == []  # neither this set nor the one around it is touched
                assert mine[0].reached() == "" and live[0].reached() == ""
    finally:
        run.kill()
        run.wait()
        remove_stale()
