"""The PD proxy: OpenAI API in front, prefill and decode nodes behind.

The routes, the admin API and the request guards live here; how a request travels over the
nodes is the mode's flow (proxy/flows: pull, push, colocated), which talks to the nodes through
`NodeClient`; `HealthPoller` keeps the nodes' health and load fresh.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from pdserve import tracing
from pdserve.api.errors import error_response, install_error_handlers, too_busy
from pdserve.api.guards import GuardMiddleware, overloaded
from pdserve.api.http import finished_before_disconnect
from pdserve.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.kv.params import parse as parse_kv_transfer_params
from pdserve.proxy.client import NodeClient, NodeError
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.dashboard import Dashboard
from pdserve.proxy.echo import prompt_only
from pdserve.proxy.flows import FLOWS, ClientRequest
from pdserve.proxy.flows.base import sequences
from pdserve.proxy.health import HealthPoller
from pdserve.proxy.membership import ROLE_FLAGS, DuplicateNode, Membership, NodesFile
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.policies import POLICIES, Node, NoHealthyNode, RoundRobin, select_decoder
from pdserve.proxy.prefix_index import NodeCache, PrefixIndex
from pdserve.proxy.records import RecentRequests, RequestRecord, record_of
from pdserve.proxy.timing import RequestTiming

__all__ = ["Proxy", "ProxyConfig"]


class AdminNode(BaseModel):
    url: str
    role: str


def estimate_tokens(body: dict[str, Any]) -> int:
    """A tokenizer-free load estimate: ~4 characters a token, plus the tokens asked for (n times)."""
    if "messages" in body:
        text = "".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    return len(text) // 4 + (max_tokens if isinstance(max_tokens, int) else 256) * sequences(body)


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        POLICIES.get(config.policy)  # a bad policy fails here, naming the choices
        flow_cls = FLOWS.get(config.mode)
        flagged = ((config.prefill_urls, "prefill"), (config.decode_urls, "decode"), (config.node_urls, "both"),
                   (config.kv_both_urls, "kv_both"))
        for urls, role in flagged:
            if urls and role not in flow_cls.roles:
                raise ValueError(f"{config.mode} mode takes {' / '.join(ROLE_FLAGS[r] for r in flow_cls.roles)} "
                                 f"URLs, not {ROLE_FLAGS[role]}")
        self.inflight = 0
        self.config = config
        self.metrics = ProxyMetrics()
        # Colocated nodes serve whole requests: they take the decoders' place in the relay.
        self.members = Membership(config.mode, flow_cls.roles, on_add=self.metrics.track,
                                  on_remove=self.metrics.untrack)
        for urls, role in flagged:
            for url in urls:
                self.members.add(url, role)
        self.nodes_file = NodesFile(config.nodes_file) if config.nodes_file else None
        if self.nodes_file:
            self.nodes_file.load(self.members)
        flow_cls.check_members(self.members)
        self.client = NodeClient(config.request_timeout_s, config.api_key)
        self.prefix_index = PrefixIndex(self.members, self.client)
        self.flow = flow_cls(config, self.members, self.client, self.metrics, self.prefix_index)
        self.health = HealthPoller(self.members, self.client, self.nodes_file, config.health_interval_s,
                                   config.max_health_failures)
        # Off (--no-dashboard): no request records, no page, no goodput counter: what they cost, saved
        self.recent = RecentRequests(config.slos) if config.dashboard else None
        self.dashboard = Dashboard(config.mode, self.members, self.recent) if config.dashboard else None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            async with self.client:
                tasks = [asyncio.create_task(self.health.run()), asyncio.create_task(self.prefix_index.run())]
                if self.dashboard is not None:
                    tasks.append(asyncio.create_task(self.dashboard.run()))
                try:
                    yield
                finally:
                    for task in tasks:
                        task.cancel()

        app = FastAPI(title="pdserve proxy", lifespan=lifespan)
        app.add_middleware(GuardMiddleware, api_key=self.config.api_key)
        install_error_handlers(app)
        if self.dashboard is not None:
            app.include_router(self.dashboard.router())

        @app.exception_handler(NodeError)
        async def _node_error(_: Request, exc: NodeError):
            if isinstance(exc.body, dict):
                return JSONResponse(exc.body, status_code=exc.status)
            return Response(exc.body, status_code=exc.status, media_type="application/json")

        @app.exception_handler(NoHealthyNode)
        async def _no_node(_: Request, exc: NoHealthyNode):
            return error_response(503, str(exc), type_="service_unavailable")

        @app.get("/health")
        async def health():
            return {"status": "ok", "mode": self.config.mode, "prefill": len(self.prefillers),
                    "decode": len(self.decoders)}

        @app.post("/v1/admin/nodes", status_code=201)
        async def add_node(node: AdminNode):
            """Add a node at run time (needs the proxy's --api-key)."""
            if denied := self._admin_denied():
                return denied
            try:
                added = self.members.add(node.url, node.role)
            except DuplicateNode as exc:
                return error_response(409, str(exc), "url")
            except ValueError as exc:
                return error_response(400, str(exc), "role" if "role" in str(exc) else "url")
            return JSONResponse(_describe(added), status_code=201)

        @app.delete("/v1/admin/nodes")
        async def remove_node(url: str):
            """Take a node out of rotation (needs --api-key); its requests in flight finish."""
            if denied := self._admin_denied():
                return denied
            try:
                return _describe(self.members.remove(url))
            except LookupError as exc:
                return error_response(404, exc.args[0], "url")

        @app.get("/v1/models")
        async def models():
            node = select_decoder(self.decoders, RoundRobin(), 0)  # the first healthy one
            response = await self.client.get(node, "/v1/models")
            return Response(response.content, status_code=response.status_code, media_type="application/json")

        @app.get("/v1/nodes")
        async def nodes():
            return {"nodes": [_describe(n, self.prefix_index.cache(n)) for n in self.members.nodes()]}

        @app.get("/v1/prometheus/targets")
        async def prometheus_targets(request: Request):
            """Prometheus' HTTP service discovery (http_sd_configs): this proxy and its nodes, each
            with its role in the pdserve_role label (docs/grafana/prometheus.yml)."""
            own = [{"targets": [request.url.netloc], "labels": {"pdserve_role": "proxy"}}]
            return own + [{"targets": [urlsplit(n.url).netloc], "labels": {"pdserve_role": n.role}}
                          for n in self.members.nodes()]

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/kv/meta")
        async def kv_meta(raw: Request):
            """Push mode: a decode node says where P should write a request's KV."""
            try:
                params = parse_kv_transfer_params(json.loads(await raw.body()))
            except json.JSONDecodeError:
                params = None
            if params is None or params.proxy_request_id is None:
                return error_response(400, "expected a JSON object with proxy_request_id", "proxy_request_id")
            if not self.flow.announce(params):
                return error_response(404, "no request is waiting for this announcement", "proxy_request_id")
            return {"status": "ok"}

        # The bodies are validated (and published in the OpenAPI spec) here, so a bad request is
        # refused before any node works on it; the raw JSON is what gets forwarded.
        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, raw: Request):
            return await self.handle(raw, "/v1/completions", body)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, raw: Request):
            return await self.handle(raw, "/v1/chat/completions", body)

        return app

    @property
    def prefillers(self) -> list[Node]:
        return self.members.prefillers

    @property
    def decoders(self) -> list[Node]:
        return self.members.decoders

    def _admin_denied(self) -> JSONResponse | None:
        # The key itself was checked by GuardMiddleware; without one the admin API stays shut.
        if self.config.api_key is None:
            return error_response(403, "the admin API needs the proxy to be started with --api-key")
        return None

    # -- requests -------------------------------------------------------------------------------

    async def handle(self, raw: Request, path: str, parsed: CompletionRequest | ChatCompletionRequest):
        if overloaded(self.inflight, self.config.max_waiting):
            return too_busy(self.inflight)
        self.inflight += 1
        try:
            # A client that leaves while P prefills (or before D answers) cancels the flow: the
            # node connections close, and the nodes abort the request and free its blocks.
            work = asyncio.ensure_future(self._handle(raw, path, parsed))
            if await finished_before_disconnect(raw, work):
                return work.result()
            return Response(status_code=499)
        finally:
            self.inflight -= 1

    async def _handle(self, raw: Request, path: str, parsed: CompletionRequest | ChatCompletionRequest):
        arrival = time.perf_counter()
        body = json.loads(await raw.body())  # already validated against the request model: forward it as sent
        if "kv_transfer_params" in body:
            return error_response(400, "kv_transfer_params is set by the proxy, not by clients", "kv_transfer_params")
        for name in ("max_tokens", "max_completion_tokens"):  # caught here, before P holds any KV
            value, least = body.get(name), 0 if prompt_only(body) else 1  # 0: the scoring call (proxy/echo.py)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                return error_response(400, f"{name} must be an integer >= 1 (0 only with echo or prompt_logprobs), "
                                           f"got {value!r}", name)
        req = ClientRequest(path, body, estimate_tokens(body), RequestTiming(arrival, arrival_unix=time.time()), parsed)
        if tracing.enabled():
            req.span = tracing.start("pdserve.request", tracing.incoming(raw.headers), req.request_id,
                                     {"pdserve.mode": self.config.mode, "http.route": path}, arrival, server=True)
        if self.recent is not None:
            self.recent.start(req.request_id, lambda: self._record(req, "running"))
        try:
            response = await self.flow.serve(req)
        except NodeError as exc:
            self._finish(req, "error", exc.status, _message(exc.body))
            raise
        except NoHealthyNode as exc:
            self._finish(req, "error", 503, str(exc))
            raise
        except asyncio.CancelledError:  # the client left before the answer began
            self._finish(req, "aborted", 499)
            raise
        except Exception as exc:
            self._finish(req, "error", 500, repr(exc))
            raise
        response.headers["x-pdserve-request-id"] = req.request_id
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._recorded(response.body_iterator, req, response.status_code)
        else:
            self._finish(req, "ok" if response.status_code == 200 else "error", response.status_code)
        return response

    async def _recorded(self, chunks: AsyncIterator, req: ClientRequest, status: int) -> AsyncIterator:
        """A streamed answer's bytes; its record is finished when the stream ends, however it ends."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            timing = req.timing
            outcome = "ok" if timing.done is not None else "error" if timing.error else "aborted"
            self._finish(req, outcome, status if outcome != "aborted" else 499, timing.error)

    def _finish(self, req: ClientRequest, status: str, http_status: int | None = None,
                error: str | None = None) -> None:
        """The request has ended: its record joins the finished ones, its spans end."""
        if self.recent is None and req.span is None:
            return
        record = self._record(req, status, http_status, error)
        if self.recent is not None:
            self.recent.finish(record, gaps=req.timing.gaps)
            if self.recent.meets(record):
                self.metrics.within_slo.inc()
        if req.span is not None:
            for span in req.open_spans:
                tracing.end(span)
            tracing.end(req.span, attributes={"pdserve.status": status, "http.status_code": http_status,
                                              "pdserve.ttft_ms": record.ttft_ms, "pdserve.e2e_ms": record.e2e_ms,
                                              "pdserve.prefill_node": record.prefill_node,
                                              "pdserve.decode_node": record.decode_node},
                        error=error if status != "ok" else None)

    def _record(self, req: ClientRequest, status: str, http_status: int | None = None,
                error: str | None = None) -> RequestRecord:
        return record_of(req.request_id, req.path, self.config.mode, bool(req.body.get("stream")), req.timing,
                         status, http_status, error)


def _message(body: Any) -> str:
    """An OpenAI error body's message (a node's error, relayed)."""
    try:
        parsed = json.loads(body) if isinstance(body, (bytes, str)) else body
        return str(parsed["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500] if isinstance(body, bytes) else str(body)[:500]


def _predicted(node: Node) -> dict[str, float]:
    """Auto mode's prediction for the node, in seconds from now (0: passed): when the prefills sent
    to it are done."""
    return {"prefill_backlog": round(max(node.prefill_backlog_until - time.monotonic(), 0.0), 3)}


def _streams(node: Node) -> dict[str, int]:
    """Auto mode: the requests placed on the node to decode, streaming (a first token relayed) or
    waiting (queued, prefilling, or their KV on its way): what a node taking turns is priced by."""
    return {"streaming": len(node.streaming), "waiting": len(node.waiting)}


def _describe(node: Node, cache: NodeCache | None = None) -> dict:
    described = {"url": node.url, "role": node.role, "healthy": node.healthy, "active_requests": node.active_requests,
                 "active_tokens": node.active_tokens, "kv_usage": node.kv_usage, "served": node.served,
                 "streams_past_itl": node.streams_past_itl,
                 "engine": node.engine,
                 "speed": {"prefill": round(node.speed.prefill, 3), "decode": round(node.speed.decode, 3)},
                 "predicted_s": _predicted(node), "streams": _streams(node)}
    if cache is not None:  # the proxy's copy of the node's prefix cache (proxy/prefix_index.py)
        described["prefix_cache"] = {"synced": cache.synced, "blocks": len(cache.hashes), "epoch": cache.epoch,
                                     "batch": cache.seq, "resyncs": cache.resyncs}
    return described
