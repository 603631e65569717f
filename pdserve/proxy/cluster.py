"""Each node's load as the dashboard shows it, read from the /metrics page the health poller
fetches anyway: the gauges as they are, the counters as rates between two polls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# counter -> the rate it becomes (per second between two polls)
RATES = {"pdserve:prefill_tokens_computed": "prefill_tokens_per_s", "pdserve:generation_tokens": "decode_tokens_per_s",
         "pdserve:engine_busy_seconds": "utilisation"}
GAUGES = {"pdserve:num_requests_waiting": "waiting", "pdserve:num_requests_running": "running",
          "pdserve:num_requests_waiting_for_remote_kv": "waiting_for_kv", "pdserve:kv_blocks_used": "kv_blocks_used",
          "pdserve:kv_blocks_total": "kv_blocks_total", "pdserve:kv_blocks_held": "kv_blocks_held",
          "pdserve:kv_transfers_failed_total": "kv_transfers_failed",
          "pdserve:kv_hold_expired_total": "kv_holds_expired"}
KV_BYTES = "pdserve:kv_transfer_bytes_total"  # by direction (sent | received) and transport


@dataclass
class MetricsPage:
    """A node's /metrics page, parsed once per poll for everyone who reads it."""

    samples: list[Sample]

    @classmethod
    def parse(cls, text: str) -> MetricsPage:
        return cls([sample for family in text_string_to_metric_families(text) for sample in family.samples])

    def value(self, name: str) -> float:
        """The unlabelled sample `name` (0 when absent)."""
        return next((s.value for s in self.samples if s.name == name and not s.labels), 0.0)

    def labels(self, name: str) -> dict[str, str]:
        """The labels of the first sample `name` (an info metric's), {} when absent."""
        return next((dict(s.labels) for s in self.samples if s.name == name), {})


@dataclass
class NodeLoad:
    """One poll of a node's metrics, with the rates since the poll before it."""

    at: float = 0.0  # monotonic seconds
    values: dict[str, float] = field(default_factory=dict)  # GAUGES' names
    totals: dict[str, float] = field(default_factory=dict)  # RATES' counters and kv_{sent,received}_bytes
    rates: dict[str, float] = field(default_factory=dict)  # RATES' names, kv_{sent,received}_bytes_per_s

    @classmethod
    def read(cls, page: MetricsPage, before: NodeLoad | None, now: float | None = None) -> NodeLoad:
        load = cls(at=time.monotonic() if now is None else now)
        for sample in page.samples:
            if sample.name in GAUGES:
                load.values[GAUGES[sample.name]] = sample.value
            elif sample.name.endswith("_total") and sample.name.removesuffix("_total") in RATES:
                load.totals[sample.name.removesuffix("_total")] = sample.value
            elif sample.name == KV_BYTES:
                key = f"kv_{sample.labels.get('direction', '')}_bytes"
                load.totals[key] = load.totals.get(key, 0.0) + sample.value
        if before is not None and load.at > before.at:
            span = load.at - before.at
            for counter, total in load.totals.items():
                name = RATES.get(counter, f"{counter}_per_s")
                load.rates[name] = max(total - before.totals.get(counter, 0.0), 0.0) / span  # (a restart: 0)
            if "utilisation" in load.rates:  # a step is counted when it ends: one may straddle two polls
                load.rates["utilisation"] = min(load.rates["utilisation"], 1.0)
        return load

    def describe(self) -> dict[str, float]:
        return {**self.values, **{name: round(rate, 3) for name, rate in self.rates.items()}}
