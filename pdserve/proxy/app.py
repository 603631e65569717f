"""The PD proxy: OpenAI API in front, a prefill node and a decode node behind each request.

Pull flow (vLLM's NixlConnector / vllm-ascend's MooncakeConnector protocol):
  1. client -> proxy: an ordinary completion or chat request.
  2. proxy -> P (`select_prefiller`): same body, `max_tokens: 1`, not streamed,
     `kv_transfer_params: {do_remote_decode: true}`. P prefills, holds the blocks and answers
     with `kv_transfer_params` saying where they are.
  3. proxy -> D (`select_decoder`): the original body plus P's `kv_transfer_params`. D pulls the
     KV, decodes, and the proxy streams D's answer back chunk by chunk.

Push flow (vllm-ascend's MooncakeLayerwiseConnector):
  1. proxy -> D first: `kv_transfer_params: {do_remote_prefill: true, kv_mode: push, metaserver,
     proxy_request_id}`. D reserves blocks and POSTs them to this proxy's `/v1/kv/meta`.
  2. proxy -> P: `max_tokens: 1`, `{do_remote_decode: true, kv_mode: push}` plus D's blocks and
     address. P pushes each layer's KV to D as soon as it is computed, then ends the push.
  3. D decodes; the proxy streams D's answer as in pull.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.node.errors import error_body, error_response, install_error_handlers, too_busy
from pdserve.node.guards import GuardMiddleware, overloaded
from pdserve.node.http import finished_before_disconnect
from pdserve.node.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.proxy.membership import DuplicateNode, Membership, NodesFile
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.policies import POLICIES, Node, NoHealthyNode, RoundRobin, select_decoder, select_prefiller

logger = logging.getLogger(__name__)
T = TypeVar("T")

PULL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
HEALTH_TIMEOUT_S = 2.0
# Fields that only make sense for the streamed answer, not for P's one-token prefill request.
_DECODE_ONLY_FIELDS = ("stream_options", "max_completion_tokens")


@dataclass
class ProxyConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    policy: str = "round_robin"
    mode: str = "pull"  # pull | push | colocated (plain load balancing over --role both nodes)
    request_timeout_s: float = 600.0
    meta_url: str = ""  # push: where decode nodes announce their blocks (this proxy's /v1/kv/meta)
    # push: how long D may take to announce its blocks. D announces once it has reserved them, and a
    # D whose pool is full queues the request until blocks free up, as it does in pull mode: so as
    # long as any request may take (a D that cannot announce answers with an error itself).
    meta_timeout_s: float = 600.0
    node_urls: list[str] = field(default_factory=list)  # colocated mode
    api_key: str | None = None  # clients must send it; the proxy also sends it to the nodes
    max_waiting: int | None = None  # requests in flight past which the proxy answers 429
    health_interval_s: float = 1.0
    max_health_failures: int = 3  # failed checks in a row before a node leaves rotation
    nodes_file: str | None = None  # JSON list of nodes, re-read when it changes (see proxy.membership)


class NodeError(Exception):
    """A node answered an error (or could not be reached); relayed with an OpenAI error body.
    `retryable`: the node failed before answering anything, so another node may take the request."""

    def __init__(self, status: int, body: bytes | dict, node: str, retryable: bool = False) -> None:
        super().__init__(f"{node} answered {status}")
        self.status, self.body, self.node, self.retryable = status, body, node, retryable


class AdminNode(BaseModel):
    url: str
    role: str


def estimate_tokens(body: dict[str, Any]) -> int:
    """A tokenizer-free load estimate: ~4 characters a token, plus the tokens asked for."""
    if "messages" in body:
        text = "".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    return len(text) // 4 + (max_tokens if isinstance(max_tokens, int) else 256)


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {config.policy!r}")
        if config.mode not in ("pull", "push", "colocated"):
            raise ValueError(f"mode must be pull, push or colocated, got {config.mode!r}")
        if config.mode == "colocated" and (config.prefill_urls or config.decode_urls):
            raise ValueError("colocated mode takes --node URLs (and no --prefill / --decode)")
        if config.mode != "colocated" and config.node_urls:
            raise ValueError(f"{config.mode} mode takes --prefill and --decode URLs (--node is for colocated)")
        if config.mode == "push" and not config.meta_url:
            raise ValueError("push mode needs the URL of this proxy's meta endpoint")
        self._announcements: dict[str, asyncio.Future] = {}  # push: proxy request id -> D's blocks
        self.inflight = 0
        self.config = config
        self.metrics = ProxyMetrics()
        # Colocated nodes serve whole requests: they take the decoders' place in the relay.
        self.members = Membership(config.mode, on_add=self.metrics.track, on_remove=self.metrics.untrack)
        for urls, role in ((config.prefill_urls, "prefill"), (config.decode_urls, "decode"), (config.node_urls, "both")):
            for url in urls:
                self.members.add(url, role)
        self.nodes_file = NodesFile(config.nodes_file, config.mode) if config.nodes_file else None
        if self.nodes_file:
            self.nodes_file.load(self.members)
        if config.mode == "colocated" and not self.members.decoders:
            raise ValueError("colocated mode needs at least one --node (or a nodes file listing \"node\")")
        if config.mode != "colocated" and not (self.members.prefillers and self.members.decoders):
            raise ValueError(f"{config.mode} mode needs at least one prefill and one decode node "
                             "(--prefill / --decode, or a nodes file)")
        self.prefill_policy = POLICIES[config.policy]()
        self.decode_policy = POLICIES[config.policy]()
        self.client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            timeout = httpx.Timeout(self.config.request_timeout_s, connect=10.0)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
            async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
                self.client = client
                poller = asyncio.create_task(self._poll_node_load())
                try:
                    yield
                finally:
                    poller.cancel()

        app = FastAPI(title="pdserve proxy", lifespan=lifespan)
        app.add_middleware(GuardMiddleware, api_key=self.config.api_key)
        install_error_handlers(app)

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
            try:
                response = await self.client.get(node.url + "/v1/models")
            except httpx.HTTPError as exc:
                return error_response(502, f"{node.role} node {node.url} unreachable: {exc}", type_="upstream_error")
            return Response(response.content, status_code=response.status_code, media_type="application/json")

        @app.get("/v1/nodes")
        async def nodes():
            return {"nodes": [_describe(n) for n in self.members.nodes()]}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/kv/meta")
        async def kv_meta(raw: Request):
            """Push mode: a decode node says where P should write a request's KV."""
            try:
                body = json.loads(await raw.body())
                future = self._announcements.get(body["proxy_request_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                return error_response(400, "expected a JSON object with proxy_request_id")
            if future is None or future.done():
                return error_response(404, "no request is waiting for this announcement", "proxy_request_id")
            future.set_result(body)
            return {"status": "ok"}

        # The bodies are validated (and published in the OpenAPI spec) here, so a bad request is
        # refused before any node works on it; the raw JSON is what gets forwarded.
        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, raw: Request):
            return await self.handle(raw, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, raw: Request):
            return await self.handle(raw, "/v1/chat/completions")

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

    async def _poll_node_load(self) -> None:
        """Health-check every node (/health) and keep its KV usage fresh for `least_loaded`."""
        while True:
            if self.nodes_file:
                self.nodes_file.poll(self.members)
            for node in self.members.nodes():
                was_healthy = node.healthy
                try:
                    ok = (await self.client.get(node.url + "/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
                    text = (await self.client.get(node.url + "/metrics", timeout=HEALTH_TIMEOUT_S)).text if ok else ""
                except httpx.HTTPError:
                    ok, text = False, ""
                node.record_check(ok, self.config.max_health_failures)
                if node.healthy != was_healthy:
                    logger.warning("%s node %s %s", node.role, node.url, "is back" if node.healthy else "left rotation")
                used, total = _sample(text, "pdserve:kv_blocks_used"), _sample(text, "pdserve:kv_blocks_total")
                if total:
                    node.kv_usage = used / total
                if text:  # a node restarted at the same URL may run another dtype
                    node.engine = engine_info(text)
            await asyncio.sleep(self.config.health_interval_s)

    # -- the flow -------------------------------------------------------------------------------

    async def handle(self, raw: Request, path: str):
        if overloaded(self.inflight, self.config.max_waiting):
            return too_busy(self.inflight)
        self.inflight += 1
        try:
            # A client that leaves while P prefills (or before D answers) cancels the flow: the
            # node connections close, and the nodes abort the request and free its blocks.
            work = asyncio.ensure_future(self._handle(raw, path))
            if await finished_before_disconnect(raw, work):
                return work.result()
            return Response(status_code=499)
        finally:
            self.inflight -= 1

    async def _handle(self, raw: Request, path: str):
        arrival = time.perf_counter()
        body = json.loads(await raw.body())  # already validated against the request model: forward it as sent
        if "kv_transfer_params" in body:
            return error_response(400, "kv_transfer_params is set by the proxy, not by clients", "kv_transfer_params")
        for name in ("max_tokens", "max_completion_tokens"):  # caught here, before P holds any KV
            value = body.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                return error_response(400, f"{name} must be an integer >= 1, got {value!r}", name)
        tokens = estimate_tokens(body)
        timing = RequestTiming(arrival)
        if self.config.mode == "push":
            # Another D means the whole flow again: the new D reserves its own blocks, P pushes into those.
            return await self._on_some_node("decode", tokens, lambda d: self._push_once(d, path, body, tokens, timing))
        if self.config.mode == "colocated":
            return await self._on_some_node("decode", tokens, lambda d: self._decode_on(d, path, body, tokens, timing))
        kv_params = await self._on_some_node(
            "prefill", tokens, lambda p: self._prefill(p, path, body, tokens, timing, dict(PULL_PREFILL_PARAMS)))
        # Another D may pull the same KV (P holds it until pulled or timed out), or recompute.
        d_body = {**body, "kv_transfer_params": kv_params}
        return await self._on_some_node("decode", tokens, lambda d: self._decode_on(d, path, d_body, tokens, timing))

    async def _on_some_node(self, role: str, tokens: int, attempt: Callable[[Node], Awaitable[T]]) -> T:
        """`attempt` on a prefill (or decode / colocated) node. While the node fails before answering
        anything, it is taken out of rotation and `attempt` runs again on another one."""
        pool, select, policy = ((self.prefillers, select_prefiller, self.prefill_policy) if role == "prefill"
                                else (self.decoders, select_decoder, self.decode_policy))
        tried: set[str] = set()
        while True:
            node = select([n for n in pool if n.url not in tried], policy, tokens)
            try:
                return await attempt(node)
            except NodeError as exc:
                # Only the chosen node's own failure moves on (in push, P's errors pass through D's attempt).
                if exc.node != node.url or not self._retry_elsewhere(exc, node, tried, pool):
                    raise

    async def _decode_on(self, node: Node, path: str, body: dict, tokens: int, timing: RequestTiming):
        """Send the answer-producing request to a D (or a colocated node) and relay its answer."""
        request = self.client.build_request("POST", node.url + path, json=body)
        node.begin(tokens)
        return await self._decode(node, asyncio.ensure_future(self._send(node, request)), body, tokens, timing)

    def _retry_elsewhere(self, exc: NodeError, node: Node, tried: set[str], pool: list[Node]) -> bool:
        """After `node` failed: take it out of rotation and say whether another node can take over."""
        if not exc.retryable:
            return False
        tried.add(node.url)
        node.healthy = False  # the health checks bring it back
        others = [n for n in pool if n.url not in tried and n.healthy]
        logger.warning("%s node %s failed before answering (%s)%s", node.role, node.url, exc,
                       "; retrying on another node" if others else "; no other node to try")
        return bool(others)

    async def _push_once(self, decoder: Node, path: str, body: dict, tokens: int, timing: RequestTiming):
        """D first (it reserves blocks and announces them), then P, which pushes layer by layer."""
        proxy_request_id = uuid.uuid4().hex
        announced = asyncio.get_running_loop().create_future()
        self._announcements[proxy_request_id] = announced
        d_params = {"do_remote_prefill": True, "kv_mode": "push", "metaserver": self.config.meta_url,
                    "proxy_request_id": proxy_request_id}
        request = self.client.build_request("POST", decoder.url + path, json={**body, "kv_transfer_params": d_params})
        decoder.begin(tokens)
        d_answer = asyncio.ensure_future(self._send(decoder, request))
        try:
            try:
                done, _ = await asyncio.wait({announced, d_answer}, timeout=self.config.meta_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # cancelled (the client left): close D's request, which frees its blocks
                await _discard(d_answer)
                decoder.end(tokens, ok=False)
                raise
            if announced not in done:  # D answered (an error) or never announced: P is not involved
                return await self._decode(decoder, d_answer, body, tokens, timing, timeout=True)
            meta = announced.result()
            p_params = {"do_remote_decode": True, "kv_mode": "push", **{k: v for k, v in meta.items() if k.startswith("remote_")}}
            prefiller = select_prefiller(self.prefillers, self.prefill_policy, tokens)
            try:
                await self._prefill(prefiller, path, body, tokens, timing, p_params)
            except BaseException:
                await _discard(d_answer)  # closing our D request aborts it there, and frees its blocks
                decoder.end(tokens, ok=False)
                raise
            return await self._decode(decoder, d_answer, body, tokens, timing)
        finally:
            self._announcements.pop(proxy_request_id, None)

    async def _send(self, node: Node, request: httpx.Request) -> httpx.Response:
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _transport_error(node, exc) from exc

    async def _prefill(self, node: Node, path: str, body: dict, tokens: int, timing: RequestTiming,
                       kv_params: dict) -> dict | None:
        p_body = {k: v for k, v in body.items() if k not in _DECODE_ONLY_FIELDS}
        p_body.update(max_tokens=1, stream=False, kv_transfer_params=kv_params)
        node.begin(tokens)
        response = None
        try:
            response = await self._post(node, path, p_body)
        finally:
            node.end(tokens, ok=response is not None and response.status_code == 200)
        timing.prefill_done = time.perf_counter()
        timing.node_queue_s = _header_s(response, "x-pdserve-queue-ms")
        timing.prefill_s = max(timing.prefill_done - timing.arrival - timing.node_queue_s, 0.0)
        if response.status_code != 200:
            raise NodeError(response.status_code, response.content, node.url)
        returned = response.json().get("kv_transfer_params")
        if kv_params.get("kv_mode") == "push":
            return None  # P pushed during its forward pass
        if not returned:
            raise NodeError(502, _upstream(502, f"prefill node {node.url} returned no kv_transfer_params"), node.url)
        return returned

    async def _decode(self, node: Node, answer: asyncio.Future, body: dict, tokens: int, timing: RequestTiming,
                      timeout: bool = False):
        """Relay D's answer (already requested; `node.begin` already counted it)."""
        if timeout and not answer.done():
            await _discard(answer)
            node.end(tokens, ok=False)
            raise NodeError(504, _upstream(504, f"decode node {node.url} did not announce its KV blocks in time"),
                            node.url)
        try:
            response = await answer
        except BaseException:
            node.end(tokens, ok=False)
            raise
        kv_wait = _header_s(response, "x-pdserve-kv-load-ms")
        if self.config.mode == "colocated":  # one node did it all: take its own queue and prefill split
            timing.node_queue_s = _header_s(response, "x-pdserve-queue-ms")
            timing.prefill_s = max(_header_s(response, "x-pdserve-ttft-ms") - timing.node_queue_s, 0.0)
            timing.prefill_done = timing.arrival + timing.node_queue_s + timing.prefill_s
        elif self.config.mode == "push":  # D waited through P's whole prefill: count only what was exposed
            kv_wait = max(kv_wait - ((timing.prefill_done or timing.arrival) - timing.arrival), 0.0)
        timing.transfer_s = kv_wait
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            node.end(tokens, ok=False)
            raise NodeError(response.status_code, content, node.url)
        if not body.get("stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:  # nothing reached the client: another node may answer
                node.end(tokens, ok=False)
                raise _transport_error(node, exc) from exc
            finally:
                await response.aclose()
            node.end(tokens)
            timing.done = time.perf_counter()
            self.metrics.observe(timing)
            return Response(content, media_type="application/json", headers=timing.stage_headers())
        return StreamingResponse(self._relay(response, node, tokens, timing), media_type="text/event-stream",
                                 headers=timing.stage_headers())

    async def _relay(self, response: httpx.Response, node: Node, tokens: int, timing: RequestTiming) -> AsyncIterator[bytes]:
        """D's SSE bytes, passed on as they come; closing either side closes the other. If D fails
        mid-stream the client gets an SSE error event and `[DONE]`, not a cut connection."""
        ok, tail = True, b""
        try:
            try:
                async for chunk in response.aiter_raw():
                    if timing.first_byte is None:
                        timing.first_byte = time.perf_counter()
                    tail = (tail + chunk)[-2:]
                    yield chunk
            except httpx.HTTPError as exc:
                ok = False
                logger.warning("%s node %s failed mid-stream: %r", node.role, node.url, exc)
                event = _upstream(502, f"{node.role} node {node.url} failed mid-stream: {exc or type(exc).__name__}")
                yield (b"" if tail in (b"", b"\n\n") else b"\n\n") + f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
                return
            timing.done = time.perf_counter()
            self.metrics.observe(timing)
        finally:
            await response.aclose()
            node.end(tokens, ok)

    async def _post(self, node: Node, path: str, body: dict) -> httpx.Response:
        try:
            return await self.client.post(node.url + path, json=body)
        except httpx.HTTPError as exc:
            raise _transport_error(node, exc) from exc


@dataclass
class RequestTiming:
    """Where one request's time went, as the proxy sees it (plus what the nodes report)."""

    arrival: float
    prefill_done: float | None = None
    node_queue_s: float = 0.0  # time in P's waiting queue (P's x-pdserve-queue-ms)
    prefill_s: float = 0.0  # P's prefill after its queue (colocated: the node's TTFT after its queue)
    transfer_s: float = 0.0  # D's wait for the KV (D's x-pdserve-kv-load-ms); push: only what was exposed
    first_byte: float | None = None
    done: float | None = None

    def stage_headers(self) -> dict[str, str]:
        """The stages known when the answer starts, for clients that draw per-request timelines."""
        return {"x-pdserve-queue-ms": f"{self.node_queue_s * 1e3:.3f}",
                "x-pdserve-prefill-ms": f"{self.prefill_s * 1e3:.3f}",
                "x-pdserve-kv-load-ms": f"{self.transfer_s * 1e3:.3f}"}


async def _discard(answer: asyncio.Future) -> None:
    """Drop a pending or received D answer, closing its connection (D then aborts the request)."""
    if not answer.done():
        answer.cancel()
    elif not answer.cancelled() and answer.exception() is None:
        await answer.result().aclose()


def _header_s(response: httpx.Response, name: str) -> float:
    """A node's `x-pdserve-*-ms` timing header, in seconds (0 when absent)."""
    try:
        return float(response.headers.get(name, 0)) / 1e3
    except ValueError:
        return 0.0


def _sample(metrics_text: str, name: str) -> float:
    """One unlabelled sample from a Prometheus text page (0 when absent)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def engine_info(metrics_text: str) -> dict[str, str]:
    """What a node runs on (device, ISA, dtype, kernels): the labels of its pdserve:engine_info."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "pdserve:engine_info":
                return dict(sample.labels)
    return {}


def _upstream(status: int, message: str) -> dict:
    return error_body(status, message, type_="upstream_error")


def _transport_error(node: Node, exc: httpx.HTTPError) -> NodeError:
    """A node that could not be reached, or failed before answering: 502 (504 for a timeout).
    Retryable unless it timed out, since then the node may still be working on the request."""
    timed_out = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
    status = 504 if timed_out else 502
    what = "timed out" if timed_out else "unreachable or failed"
    return NodeError(status, _upstream(status, f"{node.role} node {node.url} {what}: {exc or type(exc).__name__}"),
                     node.url, retryable=not timed_out)


def _describe(node: Node) -> dict:
    return {"url": node.url, "role": node.role, "healthy": node.healthy, "active_requests": node.active_requests,
            "active_tokens": node.active_tokens, "kv_usage": node.kv_usage, "served": node.served, "engine": node.engine}
