"""`pdserve up`: P nodes, D nodes and the proxy as child processes on loopback, one core each.

Every child gets PR_SET_PDEATHSIG, so it dies with this process even if it is killed outright;
on Ctrl-C / SIGTERM all children are stopped (SIGTERM, then SIGKILL) before exit.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import httpx

from pdserve.kv.channel import SECRET_ENV
from pdserve.node.guards import API_KEY_ENV

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0
MAX_HELD_LINES = 2000  # a child's output kept while it starts
LOG_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")  # pdserve's log format


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OutputRelay:
    """A child's output (stdout and stderr), read line by line on a thread of its own.

    While the child starts its lines are held back: a node that dies at start is then told in one
    line (its error), not as one traceback per node. Once it is up they are relayed to our stderr,
    the held ones first, each distinct message once across the children released together.
    """

    def __init__(self, stream, hold: bool) -> None:
        self.held: list[str] | None = [] if hold else None
        self.recent: deque[str] = deque(maxlen=50)
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace")
                with self.lock:
                    self.recent.append(line)
                    if self.held is not None:
                        if len(self.held) < MAX_HELD_LINES:
                            self.held.append(line)
                        continue
                    sys.stderr.write(line)

    def release(self, seen: set[str]) -> None:
        """Relay from now on, after the held lines whose message is not in `seen` (updated)."""
        with self.lock:
            for line in self.held or ():
                message = LOG_TIMESTAMP.sub("", line)
                if message not in seen:
                    seen.add(message)
                    sys.stderr.write(line)
            self.held = None

    def last_error(self) -> str:
        """The last line that says something: a traceback's exception line, or a CLI error."""
        with self.lock:
            return next((line.strip() for line in reversed(self.recent) if line.strip()), "")

    def save(self, name: str) -> str:
        """Write what was held to a file in the temp dir (for a child that failed); its path."""
        with self.lock:
            fd, path = tempfile.mkstemp(prefix=f"pdserve-up-{name}-", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.writelines(self.held if self.held is not None else self.recent)
        return path


def _child_setup(core: int | None):
    def setup() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if core is not None:
            os.sched_setaffinity(0, {core})

    return setup


@dataclass
class Child:
    name: str
    args: list[str]
    url: str
    core: int | None
    role: str = ""
    proc: subprocess.Popen | None = None
    output: OutputRelay | None = None

    @classmethod
    def on_free_port(cls, name: str, args: list[str], core: int | None = None, role: str = "") -> "Child":
        """A `pdserve <args>` child listening on a free loopback port."""
        port = free_port()
        return cls(name, [*args, "--host", "127.0.0.1", "--port", str(port)], f"http://127.0.0.1:{port}", core, role)

    def start(self, env: dict[str, str] | None = None, hold_output: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *self.args], preexec_fn=_child_setup(self.core),
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.output = OutputRelay(self.proc.stdout, hold_output)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ChildFailed(RuntimeError):
    """A child died while starting: its status and last error line, in one line."""

    def __init__(self, child: Child) -> None:
        child.proc.wait()
        if child.output:
            child.output.thread.join(2.0)  # the last of its output
        message = f"{child.name} exited with status {child.proc.returncode} while starting"
        error = child.output.last_error() if child.output else ""
        if error:
            message += f": {error} (full output: {child.output.save(child.name)})"
        super().__init__(message)
        self.child = child


@dataclass
class Cluster:
    children: list[Child] = field(default_factory=list)
    # One KV secret per cluster, handed to the nodes through the environment (not argv, which
    # any local user can read in ps).
    env: dict[str, str] = field(default_factory=lambda: {**os.environ, SECRET_ENV: secrets.token_hex(32)})

    def start(self, child: Child, hold_output: bool = False) -> None:
        self.children.append(child)
        child.start(self.env, hold_output)

    def launch(self, children: list[Child], timeout_s: float) -> None:
        """Start children together and wait until every one is healthy; then relay their output
        (each distinct startup message once). ChildFailed names the first that died meanwhile."""
        for child in children:
            self.start(child, hold_output=True)
        self.wait_healthy(children, timeout_s)
        seen: set[str] = set()
        for child in children:
            child.output.release(seen)

    def wait_healthy(self, children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise ChildFailed(child)
                try:
                    if httpx.get(child.url + "/health", timeout=1.0).status_code == 200:
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if pending:
                if time.monotonic() > deadline:
                    late = ", ".join(f"{c.name} (its output: {c.output.save(c.name)})" if c.output else c.name
                                     for c in pending)
                    raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {late}")
                time.sleep(0.2)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop(self) -> None:
        for child in self.children:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def plan_cores(num_nodes: int) -> list[int | None]:
    """One core per node when the machine has enough (threads then set to 1); else no pinning."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= num_nodes:
        return cores[:num_nodes]
    return [None] * num_nodes


def run_up(args) -> int:
    from pdserve.models.loader import default_model_name, resolve_model_dir
    from pdserve.platform import plan_kernels

    # Convert the model once here, so that the nodes do not race to fill the cache.
    model_dir = str(resolve_model_dir(args.model))
    plan = plan_kernels(args.dtype)  # what each node will choose on this machine (a bad setting stops us here)
    roles = ["both"] * args.colocated if args.colocated else ["prefill"] * args.prefill + ["decode"] * args.decode
    cores = plan_cores(len(roles))
    node_args = ["--model", model_dir, "--served-model-name", default_model_name(args.model), "--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
                 "--kv-transport", args.kv_transport, "--log-level", args.log_level]
    if args.max_model_len:
        node_args += ["--max-model-len", str(args.max_model_len)]
    node_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_chunked_prefill:
        node_args.append("--no-chunked-prefill")
    nodes = [
        Child.on_free_port(f"{role}-{i}", ["serve", "--role", role, *(["--threads", "1"] if core is not None else []),
                                           *node_args], core, role)
        for i, (role, core) in enumerate(zip(roles, cores))
    ]
    cluster = Cluster()
    if args.api_key:  # every node and the proxy require it; the proxy sends it on
        cluster.env[API_KEY_ENV] = args.api_key
    stop_requested = False

    def request_stop(signum, frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        shape = f"{args.colocated} colocated" if args.colocated else f"{args.prefill} prefill + {args.decode} decode"
        print(f"pdserve up: starting {shape} node(s) (cores: {cores}) on {plan.describe()}", flush=True)
        cluster.launch(nodes, args.startup_timeout)
        proxy_args = ["proxy", "--host", args.host, "--port", str(args.port), "--policy", args.policy,
                      "--log-level", args.log_level]
        if args.max_waiting is not None:
            proxy_args += ["--max-waiting", str(args.max_waiting)]
        if args.colocated:
            proxy_args += ["--mode", "colocated", "--node", *[n.url for n in nodes]]
        else:
            proxy_args += ["--mode", args.mode, "--prefill", *[n.url for n in nodes if n.role == "prefill"],
                           "--decode", *[n.url for n in nodes if n.role == "decode"]]
        proxy = Child("proxy", proxy_args, f"http://{args.host}:{args.port}", None)
        cluster.launch([proxy], 60)
        print_ready(proxy.url, "colocated" if args.colocated else args.mode)
        while not stop_requested:
            dead = cluster.dead_child()
            if dead is not None:
                print(f"pdserve up: {dead.name} exited with status {dead.proc.returncode}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print("pdserve up: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def print_ready(url: str, mode: str) -> None:
    print(
        f"\npdserve is ready ({mode} mode): {url}\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], "
        f"\"max_tokens\": 64, \"temperature\": 0}}'\n\n"
        "Ctrl-C stops every process.\n",
        flush=True,
    )
