"""Where one request's time went, as the proxy sees it."""

from __future__ import annotations

from dataclasses import dataclass, field


def exposed_push_wait(kv_wait_s: float, prefill_span_s: float) -> float:
    """Push: D waits for the KV through P's whole prefill (it reserved its blocks first); only what
    passed P's answer (`prefill_span_s` after the request arrived) is the transfer's."""
    return max(kv_wait_s - prefill_span_s, 0.0)


@dataclass
class RequestTiming:
    """Proxy-side timestamps plus the stage split the nodes report in their headers."""

    arrival: float
    arrival_unix: float = 0.0  # the same moment on the wall clock (the dashboard's time axis)
    prefill_node: str | None = None  # the P that prefilled (None: the answering node did)
    decode_node: str | None = None  # the node that answered (D, or a colocated node)
    decode_sent: float | None = None  # when the answering node was asked
    decode_queue_s: float = 0.0  # D's own queue before it scheduled the request (its x-pdserve-queue-ms)
    prompt_tokens: int | None = None  # as the node that computed the prompt counted them
    cached_tokens: int | None = None  # of those, from its prefix cache
    kv_tokens: int = 0  # prompt tokens whose KV D received from P
    kv_bytes: int = 0
    kv_blocks: int = 0
    kv_transport: str | None = None
    error: str | None = None  # why the answer failed mid-stream
    output_chunks: int = 0  # streamed: SSE events relayed, [DONE] and a usage-only event not counted
    prefill_done: float | None = None
    node_queue_s: float = 0.0  # time in P's waiting queue (P's x-pdserve-queue-ms)
    prefill_s: float = 0.0  # P's prefill after its queue (colocated: the node's TTFT after its queue)
    prefill_engine_s: float = 0.0  # of it, P's engine's own (its TTFT after its queue): the rest are hops
    prefill_step_tokens: int | None = None  # prompt tokens of every request in the steps that prefilled this one
    decode_ttft_s: float = 0.0  # P and D apart: D's engine's time from the request to its first output
    transfer_s: float = 0.0  # D's wait for the KV (D's x-pdserve-kv-load-ms); push: only what was exposed
    first_byte: float | None = None
    last_byte: float | None = None
    past_itl: bool = False  # auto under an ITL SLO: a gap between two chunks passed it (counted on its node)
    longest_gap: float = 0.0  # streamed: the longest time between two relayed chunks after the first
    gaps: list[float] = field(default_factory=list)  # streamed: every such gap (the dashboard's ITL percentiles)
    done: float | None = None
    placement: str | None = None  # auto mode: local | remote
    placement_s: float = 0.0  # auto mode: what choosing cost the proxy
    predicted_ttft_s: float | None = None  # auto mode: the chosen option's TTFT, from the profile

    def stage_headers(self) -> dict[str, str]:
        """The stages known when the answer starts, for clients that draw per-request timelines."""
        headers = {"x-pdserve-queue-ms": f"{self.node_queue_s * 1e3:.3f}",
                   "x-pdserve-prefill-ms": f"{self.prefill_s * 1e3:.3f}",
                   "x-pdserve-kv-load-ms": f"{self.transfer_s * 1e3:.3f}"}
        if self.prefill_node is not None and self.decode_sent is not None and self.prefill_done is not None:
            # P and D apart: D's own queue, and (pull) the proxy's hop from P's answer to asking D
            headers["x-pdserve-decode-queue-ms"] = f"{self.decode_queue_s * 1e3:.3f}"
            headers["x-pdserve-prefill-engine-ms"] = f"{self.prefill_engine_s * 1e3:.3f}"
            headers["x-pdserve-decode-ttft-ms"] = f"{self.decode_ttft_s * 1e3:.3f}"
            if self.decode_sent >= self.prefill_done:
                headers["x-pdserve-handoff-ms"] = f"{(self.decode_sent - self.prefill_done) * 1e3:.3f}"
        if self.placement is not None:
            headers.update({"x-pdserve-placement": self.placement,
                            "x-pdserve-placement-ms": f"{self.placement_s * 1e3:.3f}",
                            "x-pdserve-predicted-ttft-ms": f"{(self.predicted_ttft_s or 0.0) * 1e3:.3f}"})
        return headers
