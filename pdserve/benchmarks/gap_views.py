"""Where a stream's longest gap arises: as the decode engines emitted the tokens, as the nodes'
HTTP servers sent them, as the proxy relayed them, and as the client read them, over one run.

An ITL SLO bounds a request's longest gap between two tokens. The nodes' and the proxy's
histograms (pdserve:request_longest_gap_seconds, pdserve:stream_longest_gap_seconds,
pdserve_proxy:longest_gap_seconds), read before and after a run, give the share of requests within
each bound at each hop; the client's is exact. Where the engine's share is high and a later hop's
low, the gap is made between them (the node's event loop, the relay, their time slices); where the
engine's is low too, it is the engine's steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.histogram_buckets import LATENCY_BUCKETS

BOUNDS_S = tuple(b for b in LATENCY_BUCKETS if 0.04 <= b <= 1.0)
ENGINE = "pdserve:request_longest_gap_seconds"
SERVER = "pdserve:stream_longest_gap_seconds"
PROXY = "pdserve_proxy:longest_gap_seconds"
VIEWS = ("engine", "server", "proxy", "client")


def buckets(metrics_text: str, name: str) -> list[float]:
    """The histogram's cumulative counts at BOUNDS_S, then its total count (zeros where absent)."""
    counts = dict.fromkeys([*BOUNDS_S, float("inf")], 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name + "_bucket" and float(sample.labels["le"]) in counts:
                counts[float(sample.labels["le"])] += sample.value
    return list(counts.values())


@dataclass
class Pages:
    """One read of the /metrics pages of a pdserve proxy and of each of its nodes (by URL), which
    every benchmark reading before and after a run shares (here and benchmarks/host_load.py)."""

    proxy: str
    nodes: dict[str, str]

    @classmethod
    def fetch(cls, url: str) -> Pages:
        nodes = httpx.get(url + "/v1/nodes", timeout=10).json()["nodes"]
        return cls(httpx.get(url + "/metrics", timeout=10).text,
                   {n["url"]: httpx.get(n["url"] + "/metrics", timeout=10).text for n in nodes})


def read(pages: Pages) -> dict[str, list[float]]:
    """The proxy's and its nodes' (summed) longest-gap histograms."""
    summed = {view: [sum(col) for col in zip(*(buckets(text, name) for text in pages.nodes.values()))]
              for view, name in (("engine", ENGINE), ("server", SERVER))}
    return {**summed, "proxy": buckets(pages.proxy, PROXY)}


def shares(before: dict[str, list[float]], after: dict[str, list[float]], client_gaps_ms: list[float]) -> dict:
    """Per view, the share of the run's requests whose longest gap was within each bound (ms)."""
    out = {}
    for view in VIEWS[:-1]:
        delta = [a - b for a, b in zip(after[view], before[view])]
        total = delta[-1]
        out[view] = {"requests": int(total),
                     "within_ms": {f"{b * 1e3:.0f}": (d / total if total else None) for b, d in zip(BOUNDS_S, delta)}}
    n = len(client_gaps_ms)
    out["client"] = {"requests": n, "within_ms": {f"{b * 1e3:.0f}": (sum(g <= b * 1e3 for g in client_gaps_ms) / n
                                                                     if n else None) for b in BOUNDS_S}}
    return out


def line(views: dict) -> str:
    """One printed line: the share within each bound, engine / server / proxy / client (a view an
    older run did not record: -)."""
    cells = []
    for bound in views["client"]["within_ms"]:
        shares_ = [views[v]["within_ms"][bound] if v in views else None for v in VIEWS]
        cells.append(f"{bound} ms " + "/".join("-" if s is None else f"{s * 100:.0f}" for s in shares_))
    return "longest gap within (engine/server/proxy/client %): " + ", ".join(cells)
