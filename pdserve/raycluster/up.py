"""`pdserve up --ray`: the P and D nodes as Ray actors across a Ray cluster's machines, the
proxy on this one.

- Connect: `--ray HOST:PORT` (or $RAY_ADDRESS) joins that cluster, and fails within seconds,
  naming it, if it does not answer as a Ray GCS. `--ray auto` joins the cluster whose head `ray
  start` recorded in Ray's temp dir only if that head is on this machine and names its cluster id
  within GCS_ANSWER_S; a record that fails either is stale (a cluster long gone, or one inside a
  network namespace since deleted): it is said so, never connected to, and a cluster starts here.
- Place: one placement group with a bundle per node (`--ray-cpus` CPUs each), spread across the
  Ray nodes or packed onto as few as fit (`--ray-placement spread|pack`).
- Start: a `NodeActor` per node (actor.py), each restarted by Ray up to `--ray-max-restarts` times.
- Membership: the proxy (a child process here) reads a nodes file that this launcher rewrites
  from Ray's view every second: an actor that does not answer is taken out; once Ray has
  restarted it, its new address goes in. The proxy's health checks do the rest.
- Stop (Ctrl-C, SIGTERM): the proxy, every actor (without restart) and the placement group go;
  a Ray cluster started here is shut down.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any

from pdserve.kv.transport.shm import on_this_host
from pdserve.launcher import (StopSignal, node_command, node_roles, node_threads, node_tp, print_ready,
                              proxy_command)
from pdserve.procs import Child, ProcessGroup, cluster_env
from pdserve.raycluster.actor import NodeActor, NodeAddress

RAY_MISSING = "pdserve up --ray needs Ray: pip install 'pdserve[ray]' (or pip install 'ray>=2.40,<3')"
STRATEGIES = {"spread": "SPREAD", "pack": "PACK"}
WATCH_S = 1.0  # how often membership is read from Ray
ANSWER_S = 2.0  # an actor that does not say where it is within this is out of rotation
WAIT_NOTE_S = 5.0  # a placement still pending after this is said to be waiting for CPUs
GCS_ANSWER_S = 10.0  # a Ray head that does not name its cluster id within this is not one
# Asks a GCS for its cluster id, in a child process: Ray's client retries an address that does not
# answer as Ray without end, so the child is killed at the bound.
CLUSTER_ID_PROBE = ("import sys; from ray._raylet import GcsClient; "
                    "print(GcsClient(address=sys.argv[1]).cluster_id.hex())")


def run_up_ray(args) -> int:
    try:
        import ray
    except ImportError:
        print(RAY_MISSING, file=sys.stderr)
        return 2
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pdserve.models.locate import resolve_model_dir

    try:  # first, before any slower work: an address that is no Ray cluster fails within GCS_ANSWER_S
        address = cluster_to_join(args.ray)
    except RuntimeError as exc:
        print(f"pdserve up --ray: {exc}", file=sys.stderr)
        return 1
    model_dir = str(resolve_model_dir(args.model))  # the proxy's tokenizer (auto); converted once on this host
    roles = node_roles(args)
    # A cluster started here counts one logical CPU per node at least (as `pdserve up` runs more
    # nodes than cores when it must).
    # A TP node reserves --ray-cpus per rank, all in one bundle: its ranks run on the actor's host;
    # a node of --prefill-threads / --decode-threads N reserves N times --ray-cpus.
    cpus = [args.ray_cpus * node_tp(args, role) * (node_threads(args, role) or 1) for role in roles]
    started_here = connect(ray, address, max(os.cpu_count() or 1, sum(cpus)))
    stop = StopSignal()
    group, actors, proxies = None, [], ProcessGroup(cluster_env(args.api_key, args.otlp_endpoint))
    nodes_file = tempfile.NamedTemporaryFile("w", prefix="pdserve-ray-nodes-", suffix=".json", delete=False).name
    try:
        group = place(ray, cpus, args.ray_placement, args.startup_timeout)
        secret = secrets.token_hex(32)  # travels to the actors through Ray only
        remote = ray.remote(NodeActor)
        # args.model, not model_dir: every host resolves the model itself (the embedded one, or a path on each).
        for i, role in enumerate(roles):
            options = dict(name=f"pdserve-{role}-{i}-{os.getpid()}", num_cpus=cpus[i],
                           max_restarts=args.ray_max_restarts, max_task_retries=0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
            actors.append(remote.options(**options).remote(f"{role}-{i}", role, node_command(args, args.model, role),
                                                           secret, args.api_key, args.startup_timeout))
        addresses = ray.get([a.address_of.remote() for a in actors], timeout=args.startup_timeout)
        for a in addresses:
            print(f"pdserve up --ray: {a.name} on {a.host}: {a.url}", flush=True)
        host = proxy_host(args.host, addresses, args.mode, ray.util.get_node_ip_address())
        write_nodes_file(nodes_file, addresses)
        proxy_args = [*proxy_command(args, model_dir, host), "--nodes-file", nodes_file,
                      "--meta-url", f"http://{host}:{args.port}/v1/kv/meta"]
        proxy = Child("proxy", proxy_args, f"http://{host}:{args.port}", None)
        proxies.launch([proxy], 60)
        print_ready(proxy.url, "colocated" if args.colocated else args.mode)
        watcher = RayMembership(actors, addresses)
        while not stop.requested:
            if not proxy.alive():
                print(f"pdserve up --ray: the proxy exited with status {proxy.proc.returncode}; stopping",
                      file=sys.stderr)
                return 1
            if watcher.poll(ray):
                write_nodes_file(nodes_file, watcher.current())
            time.sleep(WATCH_S)
        print("pdserve up: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError, ray.exceptions.RayError) as exc:
        print(f"pdserve up --ray: {exc}", file=sys.stderr)
        return 1
    finally:
        proxies.stop()
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        os.unlink(nodes_file)
        if started_here:
            ray.shutdown()


def place(ray: Any, cpus: list[float], strategy: str, timeout_s: float) -> Any:
    """The placement group of the nodes' bundles (CPUs each), once Ray has placed it. A cluster too
    small for it fails at once; one whose CPUs are taken by others is waited for, up to timeout_s."""
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes, need, total = len(cpus), sum(cpus), ray.cluster_resources().get("CPU", 0)
    if need > total:
        raise RuntimeError(f"the Ray cluster cannot place {nodes} node(s) of {need:g} CPU(s) in all: it has "
                           f"{total:g} CPUs on {len(ray.nodes())} node(s) (fewer --ray-cpus, or more Ray nodes)")
    group = placement_group([{"CPU": c} for c in cpus], strategy=STRATEGIES[strategy], name=f"pdserve-{os.getpid()}")
    ready, _ = ray.wait([group.ready()], timeout=min(WAIT_NOTE_S, timeout_s))
    if not ready:
        free = ray.available_resources().get("CPU", 0)
        print(f"pdserve up --ray: waiting for {need:g} free CPUs in the Ray cluster ({free:g} free now)", flush=True)
        ready, _ = ray.wait([group.ready()], timeout=max(timeout_s - WAIT_NOTE_S, 0))
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster did not free {need:g} CPUs for {nodes} node(s) in {timeout_s:.0f} s")
    return group


def connect(ray: Any, address: str | None, num_cpus: int) -> bool:
    """Join the verified Ray cluster at `address` (cluster_to_join), or start one of num_cpus here
    (None); whether it was started here."""
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address is not None:
        ray.init(address=address, **quiet)
        print(f"pdserve up --ray: joined the Ray cluster at {address}", flush=True)
        return False
    # Without usage stats: Ray's would probe cloud metadata addresses (169.254.169.254) off this machine.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, **quiet)
    print("pdserve up --ray: started a Ray cluster on this machine", flush=True)
    return True


def cluster_to_join(requested: str) -> str | None:
    """The verified address of the cluster to join, or None to start one here.

    Given (--ray HOST:PORT, $RAY_ADDRESS): it must answer as a Ray GCS, or this raises. Recorded (the
    head address `ray start` left in Ray's temp dir): joined only if it is an address of this
    machine that answers as a Ray GCS; otherwise it is stale, said so in one line, and not used."""
    given, source = (requested, "--ray") if requested != "auto" else (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
    if given:
        if ray_cluster_id(given) is None:
            raise RuntimeError(f"no Ray cluster answers at {given} (from {source}): its GCS did not name a "
                               f"cluster id within {GCS_ANSWER_S:.0f} s")
        return given
    record = ray_address_file()
    try:
        with open(record) as f:
            recorded = f.read().strip()
    except OSError:
        return None
    host = recorded.rpartition(":")[0].strip("[]")
    if not host or not on_this_host(host):
        why = "is not an address of this machine"
    elif ray_cluster_id(recorded) is None:
        why = f"did not answer as a Ray GCS within {GCS_ANSWER_S:.0f} s"
    else:
        return recorded
    print(f"pdserve up --ray: the Ray head recorded in {record} ({recorded}) {why}: stale, starting a Ray "
          "cluster here", flush=True)
    return None


def ray_address_file() -> str:
    """Where `ray start --head` records its head's address (Ray's temp dir: $RAY_TMPDIR, $TMPDIR or /tmp)."""
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(tmp, "ray", "ray_current_cluster")


def ray_cluster_id(address: str, timeout_s: float = GCS_ANSWER_S) -> str | None:
    """The cluster id the Ray GCS at `address` names within timeout_s, or None (not Ray, not there)."""
    try:
        done = subprocess.run([sys.executable, "-c", CLUSTER_ID_PROBE, address], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or not lines or not all(c in "0123456789abcdef" for c in lines[-1]):
        return None
    return None if set(lines[-1]) <= {"f"} else lines[-1]  # the nil id: no cluster behind it


def proxy_host(host: str, nodes: list[NodeAddress], mode: str, here: str) -> str:
    """Where the proxy listens. Push mode needs the decode nodes to reach it (they announce their
    blocks to it): on loopback, only if they all run on this machine."""
    if mode == "push" and host in ("127.0.0.1", "localhost") and any(n.host != here for n in nodes):
        raise RuntimeError(f"push mode across machines: decode nodes must reach the proxy; listen on this "
                           f"machine's address (--host {here})")
    return here if host in ("0.0.0.0", "::") else host


def write_nodes_file(path: str, nodes: list[NodeAddress]) -> None:
    """The proxy's nodes file (proxy/membership.py), replaced whole so it never reads half of one."""
    listed: dict[str, list[str]] = {}
    for n in nodes:
        listed.setdefault({"both": "node"}.get(n.role, n.role), []).append(n.url)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(listed, f)
    os.replace(tmp, path)


class RayMembership:
    """Which actors answer, and where: read from Ray once a second, without piling up calls on an
    actor that is restarting (its pending call is reused until it answers or fails)."""

    def __init__(self, actors: list, addresses: list[NodeAddress]) -> None:
        self.actors = actors
        self.addresses: list[NodeAddress | None] = list(addresses)
        self.pending: dict[int, Any] = {}

    def current(self) -> list[NodeAddress]:
        return [a for a in self.addresses if a is not None]

    def poll(self, ray: Any) -> bool:
        """Ask every actor where it is; whether the membership changed."""
        for i, actor in enumerate(self.actors):
            if i not in self.pending:
                self.pending[i] = actor.address_of.remote()
        done, _ = ray.wait(list(self.pending.values()), num_returns=len(self.pending), timeout=ANSWER_S)
        before = list(self.addresses)
        for i, ref in list(self.pending.items()):
            if ref in done:
                del self.pending[i]
                try:
                    self.addresses[i] = ray.get(ref)
                except ray.exceptions.RayError:  # died: out until Ray has restarted it
                    self.addresses[i] = None
            else:
                self.addresses[i] = None  # not answering now: out of rotation
        return self.addresses != before
