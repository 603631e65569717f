"""OpenTelemetry traces across proxy -> P -> D, off unless asked for.

`--otlp-endpoint URL` (or $OTEL_EXPORTER_OTLP_ENDPOINT) makes a process export its spans to that
collector over OTLP/HTTP (pdserve[otel]). The W3C `traceparent` travels in the HTTP headers
(proxy -> P, proxy -> D) and in `kv_transfer_params` and the KV side channel's messages (D's pull
from P, P's push to D), so one request's spans from every process share one trace.

Off, `enabled()` is False and every caller skips its span work: nothing is imported or allocated.
Engine-side stages (queue, prefill, KV load, decode) are made after the fact from the request's
own timestamps (perf_counter seconds), so tracing adds nothing to the engine thread either.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

_tracer: Any = None  # an opentelemetry Tracer once set up
_propagator: Any = None
# perf_counter seconds -> epoch ns: the engine stamps its requests with perf_counter
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def setup(service: str, endpoint: str | None = None) -> bool:
    """Export this process's spans as `service` to `endpoint` (or $OTEL_EXPORTER_OTLP_ENDPOINT);
    False (tracing stays off) when neither is set."""
    global _tracer, _propagator
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        raise ValueError(f"--otlp-endpoint needs OpenTelemetry's SDK and OTLP exporter: pip install "
                         f"'pdserve[otel]' ({exc})") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    atexit.register(provider.shutdown)  # what is still batched goes out at exit
    _tracer, _propagator = provider.get_tracer("pdserve"), TraceContextTextMapPropagator()
    return True


def traces_url(endpoint: str) -> str:
    """A collector's base URL -> its OTLP/HTTP traces path (an URL that names it stays as it is)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def enabled() -> bool:
    return _tracer is not None


def epoch_ns(perf_s: float) -> int:
    return int(perf_s * 1e9) + _EPOCH_OFFSET_NS


def _context(traceparent: str | None):
    return _propagator.extract({"traceparent": traceparent}) if traceparent else None


def start(name: str, traceparent: str | None, request_id: str, attributes: dict | None = None,
          start_s: float | None = None, server: bool = False):
    """A span (end it with `end`), a child of `traceparent` (W3C) or a new trace's root; every span
    names the request as the process that makes it knows it (`pdserve.request_id`)."""
    from opentelemetry.trace import SpanKind

    attributes = {"pdserve.request_id": request_id, **(attributes or {})}
    return _tracer.start_span(name, context=_context(traceparent), attributes=attributes,
                              kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                              start_time=None if start_s is None else epoch_ns(start_s))


def end(span, end_s: float | None = None, attributes: dict | None = None, error: str | None = None) -> None:
    if attributes:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=None if end_s is None else epoch_ns(end_s))


def record(name: str, traceparent: str | None, request_id: str, start_s: float, end_s: float,
           attributes: dict | None = None) -> str:
    """A span that already happened (perf_counter seconds); its own traceparent, for children."""
    span = start(name, traceparent, request_id, attributes, start_s)
    end(span, end_s)
    return traceparent_of(span)


def traceparent_of(span) -> str:
    from opentelemetry.trace import set_span_in_context

    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=set_span_in_context(span))
    return carrier["traceparent"]


def transfer_attributes(block_tables: list[list[int]], transport: str) -> dict:
    """A KV transfer span's attributes known before it moves anything."""
    return {"pdserve.kv.transport": transport, "pdserve.kv.blocks": sum(len(table) for table in block_tables)}


def incoming(headers) -> str | None:
    """The `traceparent` a request came with (None: it starts a trace here)."""
    return headers.get("traceparent") if enabled() else None
