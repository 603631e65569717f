"""Start real pdserve processes on free loopback ports (pdserve.procs), and read their metrics."""

from __future__ import annotations

import os
import re
import time

import httpx

from pdserve.procs import Child, ChildFailed, ProcessGroup, free_port

MODEL = "SmolLM2-135M-Instruct"
NODE = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.15"]  # what transformers computes

__all__ = ["Procs", "free_port", "metric", "start_pdserve", "wait_for_metric"]


def pdserve_child(args: list[str], tmp_dir, name: str, ready_path: str = "/health") -> Child:
    """`pdserve <args> --port <free>`, its output in `<tmp_dir>/<name>.log`."""
    return Child.on_free_port(name, args, ready_path=ready_path, log_path=os.path.join(str(tmp_dir), f"{name}.log"))


def wait_ready(child: Child, timeout: float = 120.0) -> Child:
    """Wait until the started child answers its ready path; a failure carries its whole log."""
    try:
        ProcessGroup().wait_ready([child], timeout)
    except ChildFailed as exc:
        raise RuntimeError(f"{exc}:\n{child.log()}") from None
    except TimeoutError:
        child.stop()
        raise TimeoutError(f"{child.name} not ready after {timeout}s:\n{child.log()}") from None
    return child


def start_pdserve(args: list[str], tmp_dir, name: str, ready_path: str = "/health", timeout: float = 120.0) -> Child:
    """Run `pdserve <args> --port <free>` and wait until `ready_path` answers 200."""
    child = pdserve_child(args, tmp_dir, name, ready_path)
    child.start()
    return wait_ready(child, timeout)


class Procs(ProcessGroup):
    """pdserve processes started under distinct names (so that no log is overwritten), each waited
    for, and stopped together (killed ones included) however the `with` block ends; their logs go
    to `tmp_dir`."""

    def __init__(self, tmp_dir) -> None:
        super().__init__(stop_grace_s=15.0)
        self.tmp_dir = tmp_dir

    def start(self, args: list[str], name: str) -> Child:  # type: ignore[override]
        return wait_ready(super().start(pdserve_child(args, self.tmp_dir, name)))

    def values(self) -> list[Child]:
        return list(self.children)

    def stop(self) -> None:
        super().stop()
        assert all(c.proc.poll() is not None for c in self.children)


def metric(url: str, name: str, labels: str | None = None) -> float:
    """A sample from a Prometheus /metrics page (0 when absent): the one without labels, or the sum
    of those whose labels include every `key="value"` of `labels` (e.g. over every transport)."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    if not labels:
        match = re.search(rf"^{re.escape(name)}(?:\{{\}})? ([0-9.eE+-]+)$", text, re.M)
        return float(match.group(1)) if match else 0.0
    pairs = re.compile(r'\w+="[^"]*"')
    samples = re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", text, re.M)
    return sum(float(value) for found, value in samples if set(pairs.findall(labels)) <= set(pairs.findall(found)))


def wait_for_metric(url: str, name: str, expected: float, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    value = metric(url, name)
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        value = metric(url, name)
    return value
