"""Proxy-side metrics: TTFT as the client sees it and the per-stage split of each request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.api.histogram_buckets import LATENCY_BUCKETS, REQUEST_BUCKETS

if TYPE_CHECKING:
    from pdserve.proxy.policies import Node
    from pdserve.proxy.timing import RequestTiming


PLACEMENT_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("pdserve_proxy:time_to_first_token_seconds", "Arrival at the proxy to D's first byte",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_proxy:e2e_request_latency_seconds", "Arrival to last byte",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.stage = Histogram("pdserve_proxy:stage_seconds", "Time per stage: queue, prefill, transfer, decode",
                               ["stage"], buckets=REQUEST_BUCKETS, registry=r)
        self.longest_gap = Histogram("pdserve_proxy:longest_gap_seconds",
                                     "Per streamed request, the longest time between two relayed chunks",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdserve_proxy:requests", "Requests relayed to the end", registry=r)
        self.within_slo = Counter("pdserve_proxy:requests_within_slo",
                                  "Requests answered within every --slo (without --slo: every answered one): goodput",
                                  registry=r)
        self.placements = Counter("pdserve_proxy:placement", "Auto mode's choices: local or remote prefill",
                                  ["choice"], registry=r)
        self.placement_seconds = Histogram("pdserve_proxy:placement_seconds", "What choosing a placement cost",
                                           buckets=PLACEMENT_BUCKETS, registry=r)
        # Streamed answers placed by auto mode: predicted and measured TTFT, summed (their ratio is the bias).
        self.predicted_ttft = Counter("pdserve_proxy:placement_predicted_ttft_seconds",
                                      "Predicted TTFT of placed streamed requests", ["choice"], registry=r)
        self.actual_ttft = Counter("pdserve_proxy:placement_actual_ttft_seconds",
                                   "Measured TTFT of placed streamed requests", ["choice"], registry=r)
        self.active = Gauge("pdserve_proxy:node_active_requests", "In-flight requests per node", ["node", "role"],
                            registry=r)

    def placed(self, choice: str, seconds: float) -> None:
        self.placements.labels(choice=choice).inc()
        self.placement_seconds.observe(seconds)

    def track(self, node: Node) -> None:
        self.active.labels(node=node.url, role=node.role).set_function(lambda: node.active_requests)

    def untrack(self, node: Node) -> None:
        self.active.remove(node.url, node.role)

    def observe(self, t: RequestTiming) -> None:
        if t.done is None:
            return
        self.requests.inc()
        if t.first_byte is not None:  # streamed answers only: a plain answer has no first token
            self.ttft.observe(t.first_byte - t.arrival)
            if t.last_byte is not None and t.last_byte > t.first_byte:
                self.longest_gap.observe(t.longest_gap)
            if t.placement is not None and t.predicted_ttft_s is not None:
                self.predicted_ttft.labels(choice=t.placement).inc(t.predicted_ttft_s)
                self.actual_ttft.labels(choice=t.placement).inc(t.first_byte - t.arrival)
        self.e2e.observe(t.done - t.arrival)
        prefill_end = t.prefill_done if t.prefill_done is not None else t.arrival
        self.stage.labels(stage="queue").observe(t.node_queue_s)
        self.stage.labels(stage="prefill").observe(t.prefill_s)
        self.stage.labels(stage="transfer").observe(t.transfer_s)
        self.stage.labels(stage="decode").observe(max(t.done - prefill_end - t.transfer_s, 0.0))
