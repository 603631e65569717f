"""What every flow shares: picking a node with retries, P's one-token prefill request, and
relaying the answer (streamed or whole) back to the client.

A flow is one way of serving a request over the nodes (the proxy's `--mode`). It writes `serve`
from these pieces and says how the nodes' timing headers split into stages (`split_stages`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar, TypeVar

import httpx
from fastapi.responses import Response, StreamingResponse

from pdserve import tracing
from pdserve.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.kv.params import KVTransferParams
from pdserve.proxy.client import (NodeClient, NodeError, discard, header_int, header_seconds, unreachable,
                                  upstream_error)
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.echo import PromptPart, for_decode, for_prefill, reports_prompt
from pdserve.proxy.membership import ROLE_FLAGS, ROLE_NAMES, Membership
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.policies import POLICIES, Node, Stream, select_decoder, select_prefiller
from pdserve.proxy.prefix_index import PrefixIndex
from pdserve.proxy.timing import RequestTiming

logger = logging.getLogger(__name__)
SSE_END = b"data: [DONE]\n\n"  # how every SSE stream of the nodes ends
T = TypeVar("T")

# Fields that only make sense for the streamed answer, not for P's one-token prefill request.
_DECODE_ONLY_FIELDS = ("stream_options", "max_completion_tokens")


@dataclass
class ClientRequest:
    """One client request as a flow sees it: the validated body, forwarded as the client sent it."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    tokens: int  # load estimate, for the policies
    timing: RequestTiming
    parsed: CompletionRequest | ChatCompletionRequest | None = None  # the body as validated (auto mode tokenizes it)
    prompt_part: PromptPart | None = None  # echo / prompt logprobs from P, put before D's answer (proxy/echo.py)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # its record's id (x-pdserve-request-id)
    span: Any = None  # tracing on: the request's span at the proxy (pdserve/tracing.py)
    open_spans: list = field(default_factory=list)  # its calls to nodes still open: ended with it
    stream: Stream | None = None  # auto: the request on its decode node, as placement prices it (Node.streams)

    def trace_headers(self, name: str, node_url: str) -> dict[str, str] | None:
        """Tracing on: a span for a call to a node, and the `traceparent` header that makes the
        node's spans its children."""
        if self.span is None:
            return None
        span = tracing.start(name, tracing.traceparent_of(self.span), self.request_id, {"pdserve.node": node_url})
        self.open_spans.append(span)
        # (the node's spans name the proxy's id too)
        return {"traceparent": tracing.traceparent_of(span), "x-pdserve-request-id": self.request_id}


def read_node_report(response: httpx.Response, timing: RequestTiming) -> None:
    """What the answering node says of the request, for its record (proxy/records.py): the prompt
    (where no P computed it), its own queue, and the KV it received."""
    if timing.prefill_node is None:
        timing.prompt_tokens = header_int(response, "x-pdserve-prompt-tokens")
        timing.cached_tokens = header_int(response, "x-pdserve-cached-tokens")
    else:
        timing.decode_queue_s = header_seconds(response, "x-pdserve-queue-ms")
        timing.decode_ttft_s = header_seconds(response, "x-pdserve-ttft-ms")
    timing.kv_tokens = header_int(response, "x-pdserve-remote-tokens") or 0
    timing.kv_bytes = header_int(response, "x-pdserve-kv-bytes") or 0
    timing.kv_blocks = header_int(response, "x-pdserve-kv-blocks") or 0
    timing.kv_transport = response.headers.get("x-pdserve-kv-transport")


def sequences(body: dict[str, Any]) -> int:
    """The n sequences a request asks for (each decodes on its own)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


class Flow(ABC):
    name: ClassVar[str]
    # The node roles it routes to: what `--prefill` / `--decode` / `--node` and a nodes file may list.
    roles: ClassVar[tuple[str, ...]] = ("prefill", "decode")

    @classmethod
    def check_members(cls, members: Membership) -> None:
        """ValueError unless the nodes can serve this flow (by default: one node of each role at least)."""
        have = {n.role for n in members.nodes()}
        if not set(cls.roles) <= have:
            needed = " and one ".join(ROLE_NAMES[r] for r in cls.roles)
            flags = " / ".join(ROLE_FLAGS[r] for r in cls.roles)
            raise ValueError(f"{cls.name} mode needs at least one {needed} node ({flags}, or a nodes file)")

    def __init__(self, config: ProxyConfig, members: Membership, client: NodeClient, metrics: ProxyMetrics,
                 index: PrefixIndex | None = None) -> None:
        self.config, self.members, self.client, self.metrics = config, members, client, metrics
        self.index = index  # the nodes' prefix caches, as the proxy follows them
        self.prefill_policy = POLICIES.get(config.policy)()
        self.decode_policy = POLICIES.get(config.policy)()
        self._releasing: set[asyncio.Task] = set()  # P holds being freed (decode_pulled)

    @abstractmethod
    async def serve(self, req: ClientRequest) -> Response:
        """The client's answer; raises NodeError for a node's error, relayed as it came."""

    def split_stages(self, response: httpx.Response, timing: RequestTiming) -> None:
        """Fill `timing` from the answering node's headers (pull: D's wait for the KV is the transfer)."""
        timing.transfer_s = header_seconds(response, "x-pdserve-kv-load-ms")

    @staticmethod
    def split_stages_one_node(response: httpx.Response, timing: RequestTiming) -> None:
        """One node did it all (colocated, or auto's local prefill): take its own queue and prefill split."""
        timing.node_queue_s = header_seconds(response, "x-pdserve-queue-ms")
        timing.prefill_s = max(header_seconds(response, "x-pdserve-ttft-ms") - timing.node_queue_s, 0.0)
        timing.prefill_done = timing.arrival + timing.node_queue_s + timing.prefill_s
        timing.prefill_step_tokens = header_int(response, "x-pdserve-prefill-step-tokens")
        timing.transfer_s = header_seconds(response, "x-pdserve-kv-load-ms")

    def announce(self, params: KVTransferParams) -> bool:
        """A node's word about a request in flight (push: D's blocks); False if nothing waits for it."""
        return False

    # -- choosing nodes -------------------------------------------------------------------------

    async def on_some_node(self, role: str, req: ClientRequest, attempt: Callable[[Node], Awaitable[T]]) -> T:
        """`attempt` on a prefill (or decode / colocated) node. While the node fails before answering
        anything, it is taken out of rotation and `attempt` runs again on another one."""
        pool, select, policy = ((self.members.prefillers, select_prefiller, self.prefill_policy) if role == "prefill"
                                else (self.members.decoders, select_decoder, self.decode_policy))
        tried: set[str] = set()
        while True:
            node = select([n for n in pool if n.url not in tried], policy, req.tokens)
            try:
                return await attempt(node)
            except NodeError as exc:
                # Only the chosen node's own failure moves on (in push, P's errors pass through D's attempt).
                if exc.node != node.url or not self._retry_elsewhere(exc, node, tried, pool):
                    raise

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

    # -- P ----------------------------------------------------------------------------------------

    async def prefill(self, node: Node, req: ClientRequest, kv_params: KVTransferParams) -> dict[str, Any] | None:
        """P's one-token request; returns the kv_transfer_params P answered with (as sent)."""
        p_body = {k: v for k, v in for_prefill(req.body).items() if k not in _DECODE_ONLY_FIELDS}
        p_body.update(max_tokens=1, n=1, stream=False, kv_transfer_params=kv_params.to_wire())  # n: D samples them
        if isinstance(p_body.get("min_tokens"), int) and p_body["min_tokens"] > 1:
            p_body["min_tokens"] = 1  # P's one token obeys it; D enforces the rest
        node.begin(req.tokens)
        response = None
        headers = req.trace_headers("proxy.prefill", node.url)
        try:
            response = await self.client.post(node, req.path, p_body, headers)
        finally:
            node.end(req.tokens, ok=response is not None and response.status_code == 200)
            if headers is not None:
                status = getattr(response, "status_code", None)
                tracing.end(req.open_spans.pop(), attributes={"http.status_code": status})
        timing = req.timing
        timing.prefill_done = time.perf_counter()
        timing.prefill_node = node.url
        timing.node_queue_s = header_seconds(response, "x-pdserve-queue-ms")
        timing.prompt_tokens = header_int(response, "x-pdserve-prompt-tokens")
        timing.cached_tokens = header_int(response, "x-pdserve-cached-tokens")
        timing.prefill_s = max(timing.prefill_done - timing.arrival - timing.node_queue_s, 0.0)
        timing.prefill_engine_s = max(header_seconds(response, "x-pdserve-ttft-ms") - timing.node_queue_s, 0.0)
        timing.prefill_step_tokens = header_int(response, "x-pdserve-prefill-step-tokens")
        if response.status_code != 200:
            raise NodeError(response.status_code, response.content, node.url)
        answer = response.json()
        if reports_prompt(req.body):  # only P computed the prompt: its part of the answer comes from here
            req.prompt_part = PromptPart.of(req.body, answer)
        return answer.get("kv_transfer_params")

    async def decode_pulled(self, prefiller: Node, kv_params: dict, decode: Awaitable[T]) -> T:
        """D's part of a pull. Should it end without an answer (the client left, no D answered), P
        frees the hold now rather than when its lease runs out (Dynamo #13855)."""
        try:
            return await decode
        except BaseException:
            task = asyncio.get_running_loop().create_task(self._release_hold(prefiller, kv_params))
            self._releasing.add(task)  # (a task nobody references may be collected before it runs)
            task.add_done_callback(self._releasing.discard)
            raise

    async def _release_hold(self, prefiller: Node, kv_params: dict) -> None:
        try:
            await self.client.post(prefiller, "/kv/release", {"request_id": kv_params.get("remote_request_id")})
        except NodeError as exc:  # P gone: its hold went with it
            logger.info("releasing a hold on %s failed: %s", prefiller.url, exc)

    async def prefill_for_pull(self, node: Node, req: ClientRequest) -> dict:
        """P prefills and holds the KV for a decode node to pull; the kv_transfer_params for D."""
        returned = await self.prefill(node, req, KVTransferParams.pull_prefill())
        if not returned:
            raise NodeError(502, upstream_error(502, f"prefill node {node.url} returned no kv_transfer_params"),
                            node.url)
        return returned

    # -- the answer -------------------------------------------------------------------------------

    def ask(self, node: Node, req: ClientRequest, body: dict[str, Any]) -> asyncio.Future[httpx.Response]:
        """Send the answer-producing request (to D, or a colocated node); `answer` relays it."""
        if "kv_transfer_params" in body and reports_prompt(body):
            body = for_decode(body)  # D computes no prompt: P reports it
        node.begin(req.tokens)
        req.timing.decode_node, req.timing.decode_sent = node.url, time.perf_counter()
        return self.client.start(node, req.path, body, req.trace_headers("proxy.decode", node.url))

    async def answer(self, node: Node, answer: asyncio.Future, req: ClientRequest) -> Response:
        """Relay the node's answer (already asked for with `ask`)."""
        try:
            response = await answer
        except BaseException:
            node.end(req.tokens, ok=False, stream=req.stream)
            raise
        self.split_stages(response, req.timing)
        read_node_report(response, req.timing)
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            node.end(req.tokens, ok=False, stream=req.stream)
            raise NodeError(response.status_code, content, node.url)
        if not req.body.get("stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:  # nothing reached the client: another node may answer
                node.end(req.tokens, ok=False, stream=req.stream)
                raise unreachable(node, exc) from exc
            finally:
                await response.aclose()
            node.end(req.tokens, stream=req.stream)
            req.timing.done = time.perf_counter()
            self.metrics.observe(req.timing)
            if req.prompt_part is not None:
                content = json.dumps(req.prompt_part.into_answer(json.loads(content))).encode()
            return Response(content, media_type="application/json", headers=req.timing.stage_headers())
        return StreamingResponse(self._relay(response, node, req), media_type="text/event-stream",
                                 headers=req.timing.stage_headers())

    async def give_up(self, node: Node, answer: asyncio.Future, req: ClientRequest) -> None:
        """Drop an answer that will not be relayed (closing it aborts the request on the node)."""
        await discard(answer)
        node.end(req.tokens, ok=False, stream=req.stream)

    async def _relay(self, response: httpx.Response, node: Node, req: ClientRequest) -> AsyncIterator[bytes]:
        """The node's SSE bytes, passed on as they come; closing either side closes the other. If the
        node fails mid-stream the client gets an SSE error event and `[DONE]`, not a cut connection."""
        ok, tail, timing = True, b"", req.timing
        usage_event = bool((req.body.get("stream_options") or {}).get("include_usage"))
        events = 0  # SSE events relayed: each ends with a blank line (the carried byte finds one split in two)
        # Under an ITL SLO (auto mode's cost rule reads it), each stream's longest gap as the proxy sees it
        itl_s = (self.config.slos or {}).get("max_itl_ms", 0.0) / 1e3 or None
        try:
            try:
                chunks = response.aiter_raw()
                if req.prompt_part is not None:
                    chunks = req.prompt_part.into_stream(chunks)
                async for chunk in chunks:
                    now = time.perf_counter()
                    if timing.first_byte is None:
                        timing.first_byte = now
                        if req.stream is not None:  # its node's turn is under way (placement.turn_ends)
                            req.stream.first_token_at = time.monotonic()
                    else:
                        gap = now - timing.last_byte
                        timing.gaps.append(gap)
                        timing.longest_gap = max(timing.longest_gap, gap)
                        if itl_s is not None and not timing.past_itl and gap > itl_s:
                            timing.past_itl = True
                            node.streams_past_itl += 1
                    timing.last_byte = now
                    events += (tail[-1:] + chunk).count(b"\n\n")
                    timing.output_chunks = max(events - usage_event, 0)
                    tail = (tail + chunk)[-len(SSE_END):]
                    yield chunk
                if tail == SSE_END:  # [DONE] is not an answer's chunk
                    timing.output_chunks = max(events - 1 - usage_event, 0)
            except httpx.HTTPError as exc:
                ok = False
                timing.error = f"{node.role} node {node.url} failed mid-stream: {exc or type(exc).__name__}"
                logger.warning("%s node %s failed mid-stream: %r", node.role, node.url, exc)
                event = upstream_error(502, f"{node.role} node {node.url} failed mid-stream: {exc or type(exc).__name__}")
                yield (b"" if not tail or tail.endswith(b"\n\n") else b"\n\n") + f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
                return
            timing.done = time.perf_counter()
            self.metrics.observe(timing)
        finally:
            if timing.done is None and tail == SSE_END:  # relayed to its end, then the client hung up first
                timing.done = timing.last_byte
                self.metrics.observe(timing)
            await response.aclose()
            node.end(req.tokens, ok, stream=req.stream)
            node.streams_past_itl -= timing.past_itl
