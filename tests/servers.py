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
