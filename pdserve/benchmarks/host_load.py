"""What a benchmark run cost the host beyond the engines' own steps: the CPU seconds the proxy, the
nodes and the in-process client used over the run, and each node's decode-only steps (count, time,
sequences, KV tokens) as its engine measured them. With nodes and serving processes on one host's
cores, the proxy's and client's per-token work runs on the nodes' cores; read against the
profile's step costs, the decode counters show how much slower an engine stepped under load, and
each engine's busy time against its thread's CPU time in it, how much of that was other work
holding its core."""

from __future__ import annotations

import time

from pdserve.benchmarks.gap_views import Pages
from pdserve.engine.messages import DecodeSteps
from pdserve.plan.profile import Profile
from pdserve.procinfo import command_line, cpu_seconds, descendants
from pdserve.proxy.cluster import MetricsPage

DECODE_COUNTERS = tuple(DecodeSteps().counters())  # a node's decode-only step counters, by name
BUSY_COUNTERS = ("engine_busy_seconds", "engine_busy_cpu_seconds")  # its computing steps' wall and CPU time


def read_counters(page: MetricsPage, names: tuple[str, ...]) -> dict[str, float]:
    """A node's counters of these names, read as the proxy's health poller reads them."""
    return {name: page.value(f"pdserve:{name}_total") for name in names}


def decode_counters(metrics_text: str) -> dict[str, float]:
    return read_counters(MetricsPage.parse(metrics_text), DECODE_COUNTERS)


def _role(pid: int) -> str:
    args = command_line(pid)
    return "proxy" if "proxy" in args else "node"


def read(up_pid: int, pages: Pages) -> dict:
    """A reading to diff: CPU seconds by role (proxy, node, client = this process), every node's
    decode and busy counters by URL (from `pages`, read just before), and the wall clock."""
    cpu = {"proxy": 0.0, "node": 0.0, "client": cpu_seconds()}
    for pid in descendants(up_pid):
        try:
            cpu[_role(pid)] += cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):  # a process that ended meanwhile
            pass
    parsed = {url: MetricsPage.parse(text) for url, text in pages.nodes.items()}  # each page once
    decode = {url: read_counters(page, DECODE_COUNTERS) for url, page in parsed.items()}
    busy = {url: read_counters(page, BUSY_COUNTERS) for url, page in parsed.items()}
    return {"wall_s": time.monotonic(), "cpu_s": cpu, "decode": decode, "busy": busy}


def delta(before: dict, after: dict) -> dict:
    """What the run between two readings used: CPU seconds by role, and each node's decode and busy counters."""
    def by_node(key: str) -> dict:
        return {url: {k: now[k] - before[key].get(url, {}).get(k, 0.0) for k in now} for url, now in after[key].items()}

    return {"wall_s": after["wall_s"] - before["wall_s"],
            "cpu_s": {role: after["cpu_s"][role] - before["cpu_s"].get(role, 0.0) for role in after["cpu_s"]},
            "decode": by_node("decode"), "busy": by_node("busy")}


def off_cpu_shares(load: dict) -> dict[str, float]:
    """Per node (URL), the share of its engine's busy time that its thread was off the CPU: other
    threads or processes held its core (the serving processes' work, a co-located node)."""
    return {url: 1 - c["engine_busy_cpu_seconds"] / c["engine_busy_seconds"]
            for url, c in load.get("busy", {}).items() if c["engine_busy_seconds"] > 0}


def against_profile(load: dict, profile: Profile, output_tokens: int) -> dict:
    """A run's load read against `profile` (a Profile, at the run's cost level): each node's mean
    decode step as measured, over the profile's step at that node's mean batch and KV (the ratio
    says how much slower an engine stepped under load than alone), each engine's off-CPU share of
    its busy time, and the proxy's and the client's CPU per streamed token."""
    ratios = []
    for counters in load["decode"].values():
        steps = counters["decode_steps"]
        if steps:
            seqs, kv = counters["decode_step_seqs"] / steps, counters["decode_step_kv_tokens"] / steps
            ratios.append(counters["decode_step_seconds"] / steps / profile.decode_step_time(max(round(seqs), 1), kv))
    per_token = {role: load["cpu_s"][role] / output_tokens if output_tokens else float("nan")
                 for role in ("proxy", "client")}
    return {"decode_step_over_profile": ratios, "off_cpu_share": list(off_cpu_shares(load).values()),
            "cpu_s_per_token": per_token,
            "node_cpu_share": load["cpu_s"]["node"] / load["wall_s"] / max(len(load["decode"]), 1)}


def decode_steps(counters_by_node: dict[str, dict]) -> dict[str, float]:
    """The nodes' decode-only steps together: how many, the mean step (ms) and the mean batch."""
    total = {k: sum(c[k] for c in counters_by_node.values()) for k in DECODE_COUNTERS}
    steps = total["decode_steps"]
    return {"steps": steps, "mean_step_ms": total["decode_step_seconds"] / steps * 1e3 if steps else float("nan"),
            "mean_seqs": total["decode_step_seqs"] / steps if steps else float("nan")}


def steps_line(real: dict[str, float], simulated: dict[str, float]) -> str:
    """Decode-only steps, real / simulated: the step and the batch behind a TPOT error."""
    return (f"decode-only steps real / sim: {real['steps']:.0f} / {simulated['steps']:.0f}, mean step "
            f"{real['mean_step_ms']:.1f} / {simulated['mean_step_ms']:.1f} ms, mean batch "
            f"{real['mean_seqs']:.2f} / {simulated['mean_seqs']:.2f}")


def line(reading: dict) -> str:
    ratios = ", ".join(f"x{r:.2f}" for r in reading["decode_step_over_profile"])
    off_cpu = ", ".join(f"{share:.1%}" for share in reading.get("off_cpu_share", []))
    per_token = reading["cpu_s_per_token"]
    return (f"decode steps under load over the profile's: {ratios or '-'}; engines' busy time off the CPU: "
            f"{off_cpu or '-'}; CPU per streamed token: proxy "
            f"{per_token['proxy'] * 1e3:.2f} ms, client {per_token['client'] * 1e3:.2f} ms; each node busy "
            f"{reading['node_cpu_share']:.0%} of a core")
