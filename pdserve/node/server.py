"""The node's OpenAI-compatible HTTP server (FastAPI): completions, chat, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from pdserve import tracing
from pdserve.api.errors import APIError, error_response, install_error_handlers, too_busy
from pdserve.api.guards import DEFAULT_MAX_BODY_BYTES, GuardMiddleware, overloaded
from pdserve.api.http import finished_before_disconnect
from pdserve.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    new_id,
    now,
)
from pdserve.api.tools import ToolCallStream, ToolUse
from pdserve.engine.client import EngineClient, EngineDeadError
from pdserve.engine.messages import RequestOutput
from pdserve.kv.params import parse as parse_kv_transfer_params
from pdserve.kv.params import wants_remote_prefill
from pdserve.node.openai_logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from pdserve.node.metrics import NodeMetrics
from pdserve.node.spans import traced
from pdserve.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)

MAX_KV_EVENTS_WAIT = 10.0  # seconds a subscriber's long poll may wait
KV_EVENTS_POLL_S = 0.02
T = TypeVar("T")


async def _prepend(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    async with aclosing(rest):
        yield first
        async for out in rest:  # ends at once if `first` was the last
            yield out


async def _finals(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[list[RequestOutput]]:
    """An iterator yielding once: each sequence's final output, by index (for _next_or_disconnect)."""
    last: dict[int, RequestOutput] = {}
    async with aclosing(outputs):
        async for out in outputs:
            last[out.index] = out
    yield [last[i] for i in sorted(last)]


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class KVReleaseRequest(BaseModel):
    """POST /kv/release: P's request id (remote_request_id in its kv_transfer_params)."""

    request_id: str = Field(min_length=1)


class NodeServer:
    """Binds an engine client to the HTTP API; `app` is the ASGI application."""

    def __init__(self, engine: EngineClient, metrics: NodeMetrics, served_model_name: str, api_key: str | None = None,
                 max_waiting: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = served_model_name
        self.api_key, self.max_waiting, self.max_body_bytes = api_key, max_waiting, max_body_bytes
        self.app = self._build_app()

    # -- app ----------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            self.engine.start()
            yield
            self.engine.stop()

        app = FastAPI(title="pdserve node", lifespan=lifespan)
        app.add_middleware(GuardMiddleware, api_key=self.api_key, max_body_bytes=self.max_body_bytes)

        install_error_handlers(app)

        @app.exception_handler(EngineDeadError)
        async def _dead(_: Request, exc: EngineDeadError):
            return error_response(503, str(exc), type_="service_unavailable")

        @app.get("/health")
        async def health():
            if not self.engine.healthy:
                return error_response(503, "engine loop is not running", type_="service_unavailable")
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> ModelList:
            return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.engine.info.max_model_len)])

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/kv/events")
        async def kv_events(after: int = 0, timeout: float = 1.0):
            """The prefix cache's event batches after `after`, waiting up to `timeout` s for one."""
            if not 0 <= timeout <= MAX_KV_EVENTS_WAIT:
                raise APIError(400, f"timeout must be within [0, {MAX_KV_EVENTS_WAIT}] seconds, got {timeout}", param="timeout")
            deadline = asyncio.get_running_loop().time() + timeout
            page = self.engine.kv_events(after)
            while not page.batches and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(KV_EVENTS_POLL_S)
                page = self.engine.kv_events(after)
            return Response(msgspec.json.encode(page), media_type="application/json")

        @app.get("/kv/snapshot")
        async def kv_snapshot():
            return Response(msgspec.json.encode(self.engine.kv_snapshot()), media_type="application/json")

        @app.post("/kv/release")
        async def kv_release(body: KVReleaseRequest):
            """P: a request's KV will not be pulled (its client left): free the hold now."""
            return {"released": self.engine.release_kv_hold(body.request_id)}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, raw: Request):
            self._check_model(body.model)
            prompt = body.single_prompt()
            prompt_ids = self.engine.tokenize(prompt)
            params = body.to_sampling_params(self._max_tokens(body, len(prompt_ids), "max_tokens"))
            echo = None
            if body.echo:  # the prompt as sent (token ids: their texts)
                echo = prompt if isinstance(prompt, str) else "".join(self.engine.token_texts(prompt_ids))
            return await self._serve(raw, body, new_id("cmpl"), prompt_ids, params, chat=False, echo=echo)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, raw: Request):
            self._check_model(body.model)
            messages, tools = body.template_inputs(self.engine.info.template_knows_tools)
            prompt = self.engine.apply_chat_template(messages, body.add_generation_prompt, tools)
            prompt_ids = self.engine.tokenize(prompt)
            param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            params = body.to_sampling_params(self._max_tokens(body, len(prompt_ids), param), param)
            return await self._serve(raw, body, new_id("chatcmpl"), prompt_ids, params, chat=True,
                                     tools=body.tool_use())

        return app

    # -- helpers ------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def _max_tokens(self, body, prompt_len: int, param: str) -> int:
        requested = body.requested_max_tokens()
        limit = self.engine.info.max_model_len
        if requested is None:
            return limit - prompt_len
        if requested >= 1 and prompt_len + requested > limit:
            raise InvalidParameter(
                param,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion).",
            )
        return requested

    async def _serve(self, raw: Request, body, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     chat: bool, echo: str | None = None, tools: ToolUse | None = None):
        kv_params = parse_kv_transfer_params(body.kv_transfer_params)
        if params.prompt_logprobs is not None and wants_remote_prefill(kv_params):
            raise InvalidParameter("echo" if echo is not None else "prompt_logprobs",
                                   "this decode node does not compute the prompt: its prefill node reports the "
                                   "prompt's logprobs (send the request through the proxy)")
        # 400 now, not on the engine thread; compiling a grammar may take a while: off the event loop.
        if params.structured is not None:
            checked = await asyncio.to_thread(self.engine.check_request, prompt_ids, params, kv_params)
        else:
            checked = self.engine.check_request(prompt_ids, params, kv_params)
        waiting = self.engine.stats().num_waiting
        if overloaded(waiting, self.max_waiting):
            return too_busy(waiting)
        answer = AnswerShape(chat, echo, body.prompt_logprobs is not None, tools)
        span = None
        if tracing.enabled():  # the request's span; a KV transfer's spans are its children
            span = tracing.start("node.request", tracing.incoming(raw.headers), request_id,
                                 {"pdserve.proxy_request_id": raw.headers.get("x-pdserve-request-id"),
                                  "pdserve.prompt_tokens": len(prompt_ids)}, server=True)
            if checked.kv_transfer_params is not None:
                checked.kv_transfer_params.traceparent = tracing.traceparent_of(span)
        outputs = self.engine.generate(request_id, checked)
        if span is not None:
            outputs = traced(outputs, span)
        # Wait for the first output before answering: a failed KV load still gets a proper HTTP
        # error, and the stage timings can go into the response headers.
        first = await self._next_or_disconnect(raw, outputs)
        if first is None:
            return Response(status_code=499)  # the client left; the request was aborted
        if first.error is not None:
            await outputs.aclose()
            raise APIError(502, first.error, type_="kv_transfer_error")
        m = first.metrics
        headers = {
            "x-pdserve-queue-ms": f"{m.queue_seconds * 1e3:.3f}",
            "x-pdserve-kv-load-ms": f"{m.kv_load_seconds * 1e3:.3f}",
            "x-pdserve-ttft-ms": f"{(m.ttft or 0.0) * 1e3:.3f}",
            # what the proxy's request records show (proxy/records.py)
            "x-pdserve-prompt-tokens": str(len(first.prompt_token_ids)),
            "x-pdserve-cached-tokens": str(m.num_cached_tokens),
            "x-pdserve-remote-tokens": str(m.num_remote_tokens),
            "x-pdserve-kv-bytes": str(m.kv_bytes),
            "x-pdserve-kv-blocks": str(m.kv_blocks),
            "x-pdserve-prefill-step-tokens": str(m.prefill_step_tokens),
        }
        if m.kv_transport:
            headers["x-pdserve-kv-transport"] = m.kv_transport
        outputs = _prepend(first, outputs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._stream(outputs, request_id, answer, params.n, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        finals = await self._next_or_disconnect(raw, _finals(outputs))
        if finals is None:
            return Response(status_code=499)
        for final in finals:
            if final.error is not None:
                raise APIError(502, final.error, type_="kv_transfer_error")
        return JSONResponse(self._full_response(finals, request_id, answer), headers=headers)

    @staticmethod
    async def _next_or_disconnect(raw: Request, outputs: AsyncIterator[T]) -> T | None:
        """The next output, or None if the client disconnected first (then the request is aborted)."""
        task = asyncio.ensure_future(anext(outputs))
        if await finished_before_disconnect(raw, task):
            return task.result()
        await outputs.aclose()
        return None

    def _usage(self, outs: list[RequestOutput]) -> dict[str, int]:
        """The prompt once, the n sequences' completions summed."""
        p, c = len(outs[0].prompt_token_ids), sum(len(out.token_ids) for out in outs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _logprobs(self, records: list | None, chat: bool, offset: int = 0,
                  echoed: RequestOutput | None = None) -> dict[str, Any] | None:
        """OpenAI's logprobs of `records`; `echoed`: completions' echo, the prompt's tokens first."""
        if records is None:
            return None
        texts = self.engine.token_texts
        if chat:
            return chat_logprobs(records, texts)
        prompt = (echoed.prompt_token_ids, echoed.prompt_logprobs) if echoed is not None else None
        return completion_logprobs(records, texts, offset, prompt)

    def _full_response(self, outs: list[RequestOutput], request_id: str, answer: AnswerShape) -> dict[str, Any]:
        kv = outs[0].kv_transfer_params
        extra = {"kv_transfer_params": kv.to_wire()} if kv else {}
        return {
            "id": request_id,
            "object": "chat.completion" if answer.chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": [self._choice(out, answer) for out in outs],
            "usage": self._usage(outs),
            **extra,
        }

    def _choice(self, out: RequestOutput, answer: AnswerShape) -> dict[str, Any]:
        logprobs = self._logprobs(out.logprobs, answer.chat, echoed=out if answer.echo is not None else None)
        if answer.chat:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            finish_reason = out.finish_reason
            if answer.tools is not None:  # the model's calls, parsed out of its text (api/tools.py)
                message["content"], calls = answer.tools.calls(out.text)
                message["tool_calls"] = [call.to_openai() for call in calls]
                finish_reason = answer.tools.finish_reason(out.finish_reason, bool(calls))
            choice = {"index": out.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": out.index, "text": (answer.echo or "") + out.text, "logprobs": logprobs,
                      "finish_reason": out.finish_reason}
        if answer.vllm_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, self.engine.token_texts)
        return choice

    async def _stream(
        self, outputs: AsyncIterator[RequestOutput], request_id: str, answer: AnswerShape, n: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        chat = answer.chat
        base = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": now(), "model": self.model_name}

        def chunk(index: int, text: str, finish_reason: str | None, first: bool = False,
                  logprobs: dict | None = None, calls: list[dict] | None = None) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        sequences: dict[int, _Sequence] = {}  # by index: what each of the n sequences has sent
        try:
            async with aclosing(outputs):
                if chat:
                    for index in range(n):
                        yield sse(chunk(index, "", None, first=True))
                async for out in outputs:
                    seq = sequences.get(out.index)
                    if seq is None:
                        tools = ToolCallStream(answer.tools) if answer.tools is not None else None
                        seq = sequences[out.index] = _Sequence(tools=tools)
                        if answer.echo is not None or answer.vllm_prompt_logprobs:  # the prompt, once, first
                            opening = chunk(out.index, answer.echo or "", None)
                            if answer.echo is not None and out.logprobs is not None:
                                opening["choices"][0]["logprobs"] = echoed = self._logprobs([], False, echoed=out)
                                seq.offset = sum(map(len, echoed["tokens"]))
                            if answer.vllm_prompt_logprobs:
                                opening["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs(
                                    out.prompt_logprobs, self.engine.token_texts)
                            yield sse(opening)
                    seq.last = out
                    text, calls, finish_reason = out.text_delta, [], out.finish_reason if out.finished else None
                    if seq.tools is not None:  # content until a call begins; each call once it is whole
                        text, calls, finish_reason = seq.tools.delta(text, out.finished, out.finish_reason)
                    if text or calls or out.finished:
                        logprobs = None
                        if out.logprobs is not None:  # every token since the last chunk, held-back text or not
                            logprobs = self._logprobs(out.logprobs[seq.reported:], chat, seq.offset)
                            seq.reported = len(out.logprobs)
                            seq.offset += sum(map(len, logprobs.get("tokens", ())))  # completions' text_offset runs on
                        seq.sent(time.perf_counter())
                        yield sse(chunk(out.index, text, finish_reason, logprobs=logprobs, calls=calls))
            for seq in sequences.values():
                if seq.chunks_sent > 1:
                    self.metrics.stream_longest_gap.observe(seq.longest_gap)
            if include_usage and sequences:
                yield sse({**base, "choices": [], "usage": self._usage([s.last for s in sequences.values()])})
        except (EngineDeadError, ValueError) as exc:
            yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": 500}})
        yield sse("[DONE]")


@dataclass
class _Sequence:
    """What one of the n sequences has streamed: its latest output, the logprobs records sent, and
    where its next text starts (completions' text_offset)."""

    last: RequestOutput | None = None
    reported: int = 0
    offset: int = 0
    tools: ToolCallStream | None = None  # chat with tools: its text split into content and calls
    chunks_sent: int = 0
    last_sent: float = 0.0
    longest_gap: float = 0.0  # between two token chunks: what an ITL SLO bounds, as this server sent them

    def sent(self, at: float) -> None:
        if self.chunks_sent:
            self.longest_gap = max(self.longest_gap, at - self.last_sent)
        self.chunks_sent, self.last_sent = self.chunks_sent + 1, at


@dataclass(frozen=True)
class AnswerShape:
    """What the answer's body holds besides the text: chat or completions; echo's prompt text;
    vLLM's prompt_logprobs field."""

    chat: bool
    echo: str | None = None
    vllm_prompt_logprobs: bool = False
    tools: ToolUse | None = None  # chat with tools: calls parsed out of the text
