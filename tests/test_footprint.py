"""Run last (conftest.py orders it): what the whole session touched outside itself.

- Every socket connect of its Python processes went to this machine or to the tests' own network
  namespaces (198.18.0.0/15): the connect guard (guard/connect_guard.py) saw them all, and refused
  (before they were made) only Ray's own probes of the cloud metadata address.
- Ray's default temp dir (/tmp/ray), ~/.ray and `ip netns list` hold nothing new after the session: no
  recorded Ray head, no session, no namespace is left for a later command to follow.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import connect_guard
from servers import free_port

PROBE = """
import socket, sys
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
try:
    socket.create_connection(("198.51.100.7", 9), timeout=5)  # TEST-NET-2: no route here, never a target
    print("connected")
except PermissionError as exc:
    print("refused:", exc)
"""


def test_the_guard_refuses_a_connect_off_this_machine_before_it_is_made(tmp_path):
    """A child Python process, as every node and proxy of the session: the guard is in it (through
    PYTHONPATH), lets loopback through and refuses the other address before any packet goes."""
    log = tmp_path / "probe.jsonl"
    done = subprocess.run([sys.executable, "-c", PROBE, str(free_port())], capture_output=True, text=True,
                          timeout=60, env={**os.environ, connect_guard.LOG_ENV: str(log)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: test connect guard: 198.51.100.7:9"), done.stdout
    kinds = [(e["host"], e["kind"]) for e in connect_guard.read_log(str(log))]
    assert kinds == [("127.0.0.1", "local"), ("198.51.100.7", "violation")]


# Refused connects that Ray makes, not pdserve: at every cluster start Ray's dashboard asks the cloud
# metadata address which cloud it runs on (ray._common.usage.usage_lib.get_cloud_from_metadata_requests),
# usage stats disabled or not. The guard refuses it before it is made.
RAYS_OWN = [("ray/dashboard/dashboard.py", "169.254.169.254", 80)]


def rays_own(entry: dict) -> bool:
    return any(entry["argv"] and entry["argv"][0].endswith(program) and (entry["host"], entry["port"]) == (host, port)
               for program, host, port in RAYS_OWN)


def test_the_session_connected_only_to_this_machine_and_its_namespaces():
    entries = connect_guard.read_log(os.environ[connect_guard.LOG_ENV])
    violations = [e for e in entries if e["kind"] == "violation" and not rays_own(e)]
    assert not violations, violations[:20]
    by_kind = collections.Counter((e["kind"], e["type"]) for e in entries)
    targets = collections.Counter(f"{e['host']}:{e['port']} ({e['kind']})" for e in entries if e["kind"] != "local")
    print(f"connect guard: {len(entries)} connects from {len({e['pid'] for e in entries})} processes: "
          f"{dict(by_kind)}; outside this machine: {dict(targets)}")


def test_ray_temp_dir_home_ray_and_namespaces_are_as_before_the_session():
    """Nothing new is left: an entry that was there before the session may be gone after (another
    run on this machine, e.g. a developer's link-fault test beside CI, removed its own namespaces),
    but no dir, file or namespace may appear that was not there before."""
    now, before = connect_guard.footprint(), connect_guard.SESSION_START
    for place, entries in now.items():
        if before[place] is None:
            assert entries is None, f"{place} did not exist before the session; now holds {entries}"
        elif entries is not None:
            assert not set(entries) - set(before[place]), f"{place}: new {sorted(set(entries) - set(before[place]))}"


def test_no_shared_kv_pool_of_the_session_is_left():
    """Every P and D pool lives in /dev/shm. A node stopped cleanly unlinks its own; one the tests
    killed (SIGKILL: no chance to) is unlinked by the next pool's creation or by the process group
    that ran it (procinfo.remove_dead_pools). Nothing the session made may outlive it."""
    left = set(connect_guard.shm_pools()) - set(connect_guard.SESSION_START_POOLS)
    assert not left, sorted(left)
