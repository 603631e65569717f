"""Start real pdserve processes on free loopback ports, and read their metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_pdserve(args: list[str], tmp_dir, name: str, ready_path: str = "/health", timeout: float = 120.0) -> Process:
    """Run `pdserve <args> --port <free>` and wait until `ready_path` answers 200."""
    port = free_port()
    log_path = os.path.join(str(tmp_dir), f"{name}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    process = Process(proc, url, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{process.log()}")
        try:
            if httpx.get(url + ready_path, timeout=1.0).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.stop()
    raise TimeoutError(f"{name} not ready after {timeout}s:\n{process.log()}")


class Procs:
    """pdserve processes started under distinct names and stopped together (killed ones included);
    a context manager, so that whatever was started is stopped and reaped however the block ends."""

    def __init__(self, tmp_dir) -> None:
        self.tmp_dir = tmp_dir
        self.by_name: dict[str, Process] = {}

    def start(self, args: list[str], name: str) -> Process:
        if name in self.by_name:
            raise ValueError(f"a process named {name!r} was already started (its log would be overwritten)")
        proc = start_pdserve(args, self.tmp_dir, name)
        self.by_name[name] = proc
        return proc

    def __getitem__(self, name: str) -> Process:
        return self.by_name[name]

    def values(self) -> list[Process]:
        return list(self.by_name.values())

    def stop(self) -> None:
        for proc in reversed(self.values()):
            proc.stop()
        assert all(p.proc.poll() is not None for p in self.values())

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def metric(url: str, name: str, labels: str | None = None) -> float:
    """Value of one sample from a Prometheus /metrics page (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    label_re = r"\{" + re.escape(labels) + r"\}" if labels else r"(?:\{\})?"
    match = re.search(rf"^{re.escape(name)}{label_re} ([0-9.eE+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for_metric(url: str, name: str, expected: float, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    value = metric(url, name)
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        value = metric(url, name)
    return value
