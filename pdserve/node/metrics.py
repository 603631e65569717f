"""Prometheus metrics of a node, named as vLLM users know them (with the `pdserve:` prefix)."""

from __future__ import annotations

import itertools

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.api.histogram_buckets import LATENCY_BUCKETS, REQUEST_BUCKETS
from pdserve.engine.messages import EngineInfo, EngineStats, RequestOutput


class NodeMetrics:
    """Request histograms fed from the engine's outputs (`observe_step`); gauges and transfer
    counters read from the engine's stats snapshot at scrape time."""

    def __init__(self, info: EngineInfo, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "pdserve:time_per_output_token_seconds", "Mean time per output token after the first, per request",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between consecutive tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Arrival to finish", buckets=REQUEST_BUCKETS, registry=r)
        # What an ITL SLO bounds, as the engine emitted the tokens (the proxy's and the client's views add the relay).
        self.longest_gap = Histogram("pdserve:request_longest_gap_seconds",
                                     "Per request, the longest time between two of its tokens", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.stream_longest_gap = Histogram("pdserve:stream_longest_gap_seconds",
                                            "Per streamed request, the longest time between two of its token chunks "
                                            "as the HTTP server sent them", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens", registry=r)
        self.prefill_tokens = Counter("pdserve:prefill_tokens_computed", "Prompt tokens computed here (not cached)", registry=r)
        self.cached_tokens = Counter("pdserve:prefix_cache_hit_tokens", "Prompt tokens served from this node's prefix cache",
                                     registry=r)
        self.success = Counter("pdserve:request_success", "Finished requests", ["finish_reason"], registry=r)
        # pdserve:engine_info{device=,device_name=,isa=,dtype=,kernels=,quantization=,attention=,
        # tensor_parallel_size=} 1: what this node runs on.
        Info("pdserve:engine", "Device, ISA, dtype, kernel paths and weight quantization of the engine", registry=r).info(info.engine_labels)
        Gauge("pdserve:num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: stats().num_running
        )
        Gauge("pdserve:num_requests_waiting", "Requests waiting to be scheduled", registry=r).set_function(
            lambda: stats().num_waiting
        )
        Gauge("pdserve:kv_blocks_used", "KV blocks in use", registry=r).set_function(lambda: stats().kv_blocks_used)
        Gauge("pdserve:kv_blocks_total", "KV blocks in the pool", registry=r).set(info.kv_blocks_total)
        Gauge("pdserve:kv_blocks_held", "KV blocks held for a decode node to pull", registry=r).set_function(
            lambda: stats().kv_blocks_held
        )
        Gauge("pdserve:num_requests_waiting_for_remote_kv", "Requests waiting for KV from a prefill node",
              registry=r).set_function(lambda: stats().num_loading)
        self.kv_load = Histogram("pdserve:kv_load_seconds", "Wait for remote KV per request (decode node)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineCounters(stats))

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after each step."""
        for out in outputs:
            m = out.metrics
            if out.new_token_ids:
                self.generation_tokens.inc(len(out.new_token_ids))
                if len(m.token_times) == 1:
                    self.ttft.observe(m.ttft)
                    self.prefill_tokens.inc(len(out.prompt_token_ids) - m.num_cached_tokens - m.num_remote_tokens)
                    self.cached_tokens.inc(m.num_cached_tokens)
                    if m.num_remote_tokens:
                        self.kv_load.observe(m.kv_load_seconds)
                else:
                    self.itl.observe(m.token_times[-1] - m.token_times[-2])
            if out.finished:
                self.observe_finished(out)

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        if out.finish_reason in ("stop", "length"):
            self.success.labels(finish_reason=out.finish_reason).inc()
        if m.token_times:
            self.e2e.observe(m.token_times[-1] - m.arrival_time)
        if len(m.token_times) > 1:
            self.tpot.observe((m.token_times[-1] - m.token_times[0]) / (len(m.token_times) - 1))
            self.longest_gap.observe(max(b - a for a, b in itertools.pairwise(m.token_times)))


class _EngineCounters(Collector):
    """Counters the engine keeps (transfers, by the connector's threads; decode-only steps), read at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats().kv
        # By direction and transport, each transfer counted once on each end, whichever moved the bytes
        nbytes = CounterMetricFamily("pdserve:kv_transfer_bytes", "KV bytes moved", labels=["direction", "transport"])
        seconds = CounterMetricFamily("pdserve:kv_transfer_seconds", "Time spent moving KV",
                                      labels=["direction", "transport"])
        for (direction, transport), (moved, spent) in sorted(s.by_transport.items()):
            nbytes.add_metric([direction, transport], moved)
            seconds.add_metric([direction, transport], spent)
        yield nbytes
        yield seconds
        yield CounterMetricFamily("pdserve:kv_transfers_failed", "KV loads that failed", value=s.transfers_failed)
        yield CounterMetricFamily("pdserve:kv_hold_expired", "Held KV freed because no D pulled it in time",
                                  value=s.holds_expired)
        yield CounterMetricFamily("pdserve:kv_remote_prompt_tokens", "Prompt tokens whose KV came from a P",
                                  value=s.remote_tokens)
        stats = self.stats()
        yield CounterMetricFamily("pdserve:engine_busy_seconds", "Time in engine steps that computed something "
                                  "(its rate is the node's utilisation)", value=stats.busy_seconds)
        yield CounterMetricFamily("pdserve:engine_busy_cpu_seconds", "The engine thread's CPU time in those steps "
                                  "(below busy seconds by the time other work held its core)",
                                  value=stats.busy_cpu_seconds)
        # Steps that only decoded: the proxy's auto mode prices decode batches by them (proxy/speed.py).
        d = stats.decode
        yield CounterMetricFamily("pdserve:decode_steps", "Engine steps that only decoded", value=d.steps)
        yield CounterMetricFamily("pdserve:decode_step_seconds", "Time in decode-only steps", value=d.seconds)
        yield CounterMetricFamily("pdserve:decode_step_seqs", "Sequences in decode-only steps, summed", value=d.seqs)
        yield CounterMetricFamily("pdserve:decode_step_kv_tokens", "KV tokens read by decode-only steps, summed",
                                  value=d.kv_tokens)
