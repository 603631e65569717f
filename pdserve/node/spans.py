"""A node's spans of one request (tracing on): the request's own span, and its stages made after
the fact from the engine's timestamps (queue, KV load, prefill, decode), so the engine thread does
no tracing work."""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from pdserve import tracing
from pdserve.engine.messages import RequestOutput


async def traced(outputs: AsyncIterator[RequestOutput], span) -> AsyncIterator[RequestOutput]:
    """The request's outputs, passed on; its span ends with the last of them, however it ends."""
    last: RequestOutput | None = None
    try:
        async with aclosing(outputs):
            async for out in outputs:
                last = out
                yield out
    finally:
        end_request(span, last)


def end_request(span, out: RequestOutput | None) -> None:
    if out is None:
        tracing.end(span, error="no output (the client left before the first)")
        return
    m, parent = out.metrics, tracing.traceparent_of(span)
    if m.first_scheduled_time is not None:
        tracing.record("queue", parent, out.request_id, m.arrival_time, m.first_scheduled_time)
        computed_from = m.first_scheduled_time
        if m.num_remote_tokens or m.kv_load_seconds:
            computed_from += m.kv_load_seconds
            tracing.record("kv.load", parent, out.request_id, m.first_scheduled_time, computed_from,
                           {"pdserve.kv.bytes": m.kv_bytes, "pdserve.kv.transport": m.kv_transport or "",
                            "pdserve.kv.tokens": m.num_remote_tokens, "pdserve.kv.blocks": m.kv_blocks})
        computed = len(out.prompt_token_ids) - m.num_cached_tokens - m.num_remote_tokens
        if m.first_token_time is not None and computed > 0:
            tracing.record("prefill", parent, out.request_id, computed_from, m.first_token_time,
                           {"pdserve.tokens": computed})
    if len(m.token_times) > 1:
        tracing.record("decode", parent, out.request_id, m.token_times[0], m.token_times[-1],
                       {"pdserve.output_tokens": len(m.token_times)})
    finished = out.finished and out.error is None and out.finish_reason != "abort"
    tracing.end(span, m.token_times[-1] if finished and m.token_times else None,
                {"pdserve.cached_tokens": m.num_cached_tokens, "pdserve.remote_tokens": m.num_remote_tokens,
                 "pdserve.finish_reason": out.finish_reason},
                error=None if finished else (out.error or f"ended before finishing ({out.finish_reason})"))
