"""pdserve child processes (nodes, proxies, `pdserve up`) started and stopped as a group.

The one helper behind `pdserve up`, the benchmarks and the tests. A `Child` is a `pdserve <args>`
process on a loopback port: pinned to a core if asked, killed with its parent (PR_SET_PDEATHSIG),
its output written to a log file or relayed through an `OutputRelay`, and ready once its ready
path answers 200. A `ProcessGroup` starts children together, waits until they are ready (a child
that dies meanwhile is a one-line `ChildFailed`), and stops every one of them, SIGTERM then
SIGKILL, however the block that used it ends.
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

from pdserve.api.guards import API_KEY_ENV
from pdserve.kv.channel import SECRET_ENV
from pdserve.procinfo import remove_dead_pools

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0
MAX_HELD_LINES = 2000  # a child's output kept while it starts
LOG_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")  # pdserve's log format


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def up_child(args: list[str] | tuple[str, ...], **kwargs) -> Child:
    """`pdserve up <args>` on a free port, ready once its proxy answers (it starts after every node)."""
    port = free_port()
    return Child("up", ["up", "--port", str(port), *args], f"http://127.0.0.1:{port}", **kwargs)


def cluster_env(api_key: str | None = None, otlp_endpoint: str | None = None) -> dict[str, str]:
    """The environment of one cluster's processes: a fresh KV secret shared by its nodes (in the
    environment, not argv, which any local user can read in ps), the API key if there is one, and
    the trace collector every process exports to (pdserve/tracing.py), if one is named."""
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32)}
    if api_key:
        env[API_KEY_ENV] = api_key
    if otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    return env


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

    def lines(self) -> list[str]:
        with self.lock:
            return list(self.held if self.held is not None else self.recent)

    def save(self, name: str) -> str:
        """Write what was held to a file in the temp dir (for a child that failed); its path."""
        fd, path = tempfile.mkstemp(prefix=f"pdserve-up-{name}-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.writelines(self.lines())
        return path


def _child_setup(cores: tuple[int, ...] | None):
    def setup() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if cores is not None:
            os.sched_setaffinity(0, set(cores))

    return setup


@dataclass
class Child:
    name: str
    args: list[str]  # pdserve's command line
    url: str
    cores: tuple[int, ...] | None = None  # pinned to these cores (None: wherever the OS runs it)
    role: str = ""
    ready_path: str = "/health"
    log_path: str | None = None  # where its output goes; None: through an OutputRelay
    proc: subprocess.Popen | None = None
    output: OutputRelay | None = None
    launcher: tuple[str, ...] = ()  # run through this first (`ip netns exec NS`: a test host's namespace)

    @classmethod
    def on_free_port(cls, name: str, args: list[str], cores: tuple[int, ...] | None = None, role: str = "",
                     **kwargs) -> Child:
        """A `pdserve <args>` child listening on a free loopback port."""
        port = free_port()
        return cls(name, [*args, "--host", "127.0.0.1", "--port", str(port)], f"http://127.0.0.1:{port}", cores, role,
                   **kwargs)

    def start(self, env: dict[str, str] | None = None, hold_output: bool = False) -> None:
        command = [*self.launcher, sys.executable, "-m", "pdserve.cli", *self.args]
        if self.log_path is None:
            self.proc = subprocess.Popen(command, preexec_fn=_child_setup(self.cores), env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.output = OutputRelay(self.proc.stdout, hold_output)
        else:
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(command, preexec_fn=_child_setup(self.cores), env=env,
                                             stdout=log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + self.ready_path, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        if self.log_path is not None:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        return "".join(self.output.lines()) if self.output else ""

    def last_error(self) -> str:
        """The last line that says something: a traceback's exception line, or a CLI error."""
        return next((line.strip() for line in reversed(self.log().splitlines()) if line.strip()), "")

    def saved_log(self) -> str:
        """Where its whole output can be read."""
        return self.log_path or (self.output.save(self.name) if self.output else "")

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; its exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        return self.reap(grace_s)

    def reap(self, timeout_s: float) -> int | None:
        """Wait for the exit (SIGKILL after `timeout_s`); its exit status."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


class ChildFailed(RuntimeError):
    """A child died while starting: its status and last error line, in one line."""

    def __init__(self, child: Child) -> None:
        child.proc.wait()
        if child.output:
            child.output.thread.join(2.0)  # the last of its output
        message = f"{child.name} exited with status {child.proc.returncode} while starting"
        error = child.last_error()
        if error:
            message += f": {error} (full output: {child.saved_log()})"
        super().__init__(message)
        self.child = child


@dataclass
class ProcessGroup:
    """Children started together and stopped together; a context manager."""

    env: dict[str, str] | None = None  # None: this process's environment
    stop_grace_s: float = STOP_GRACE_S  # `pdserve up` children need longer: they stop their own first
    children: list[Child] = field(default_factory=list)

    def start(self, child: Child, hold_output: bool = False) -> Child:
        if any(c.name == child.name for c in self.children):
            raise ValueError(f"a child named {child.name!r} was already started")
        self.children.append(child)
        child.start(self.env, hold_output)
        return child

    def launch(self, children: list[Child], timeout_s: float) -> None:
        """Start children together and wait until every one is ready; then relay their output
        (each distinct startup message once). ChildFailed names the first that died meanwhile."""
        for child in children:
            self.start(child, hold_output=True)
        self.wait_ready(children, timeout_s)
        seen: set[str] = set()
        for child in children:
            if child.output:
                child.output.release(seen)

    def wait_ready(self, children: list[Child], timeout_s: float, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise ChildFailed(child)
                if child.ready():
                    pending.remove(child)
            if pending:
                if time.monotonic() > deadline:
                    late = ", ".join(f"{c.name} (its output: {c.saved_log()})" for c in pending)
                    raise TimeoutError(f"not ready after {timeout_s:.0f}s: {late}")
                time.sleep(poll_s)

    def __getitem__(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop(self) -> None:
        """SIGTERM to every child at once, then wait for each (SIGKILL past the grace period)."""
        for child in self.children:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for child in reversed(self.children):
            child.reap(max(deadline - time.monotonic(), 0.1))
        remove_dead_pools()  # the shared KV pools of a child that was killed (it could not unlink them)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
