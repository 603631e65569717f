"""`NodeClient`: the proxy's HTTP to its nodes. A node that cannot be reached, fails or answers
an error becomes a `NodeError`, which the proxy relays with an OpenAI error body."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from pdserve.api.errors import error_body
from pdserve.proxy.policies import Node


class NodeError(Exception):
    """A node answered an error (or could not be reached); relayed with an OpenAI error body.
    `retryable`: the node failed before answering anything, so another node may take the request."""

    def __init__(self, status: int, body: bytes | dict, node: str, retryable: bool = False) -> None:
        super().__init__(f"{node} answered {status}")
        self.status, self.body, self.node, self.retryable = status, body, node, retryable


class NodeClient:
    """One pooled HTTP client for every node, opened for the proxy's lifetime (`async with`)."""

    def __init__(self, request_timeout_s: float, api_key: str | None) -> None:
        self.timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> NodeClient:
        # A pooled connection idle 30 s is dropped here before a node's server closes it (KEEP_ALIVE_S).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=30.0)
        self._http = httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def get(self, node: Node, path: str, timeout: float | None = None) -> httpx.Response:
        try:
            return await self._http.get(node.url + path, timeout=timeout or self.timeout)
        except httpx.HTTPError as exc:
            raise unreachable(node, exc) from exc

    async def post(self, node: Node, path: str, body: dict[str, Any],
                   headers: dict[str, str] | None = None) -> httpx.Response:
        """POST and read the whole answer."""
        try:
            return await self._http.post(node.url + path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise unreachable(node, exc) from exc

    def start(self, node: Node, path: str, body: dict[str, Any],
              headers: dict[str, str] | None = None) -> asyncio.Future[httpx.Response]:
        """POST in the background; the future holds the streamed answer once its headers are in.
        Cancelling the future (or closing its answer) closes the connection: the node aborts."""
        request = self._http.build_request("POST", node.url + path, json=body, headers=headers)
        return asyncio.ensure_future(self._send(node, request))

    async def _send(self, node: Node, request: httpx.Request) -> httpx.Response:
        try:
            return await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise unreachable(node, exc) from exc


async def discard(answer: asyncio.Future) -> None:
    """Drop a pending or received answer, closing its connection (the node then aborts the request)."""
    if not answer.done():
        answer.cancel()
    elif not answer.cancelled() and answer.exception() is None:
        await answer.result().aclose()


def header_seconds(response: httpx.Response, name: str) -> float:
    """A node's `x-pdserve-*-ms` timing header, in seconds (0 when absent)."""
    try:
        return float(response.headers.get(name, 0)) / 1e3
    except ValueError:
        return 0.0


def header_int(response: httpx.Response, name: str) -> int | None:
    """A node's count header (`x-pdserve-prompt-tokens`), None when absent."""
    value = response.headers.get(name)
    return int(value) if value is not None and value.isdigit() else None


def upstream_error(status: int, message: str) -> dict:
    return error_body(status, message, type_="upstream_error")


def unreachable(node: Node, exc: httpx.HTTPError) -> NodeError:
    """A node that could not be reached, or failed before answering: 502 (504 for a timeout).
    Retryable unless it timed out, since then the node may still be working on the request."""
    timed_out = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
    status = 504 if timed_out else 502
    what = "timed out" if timed_out else "unreachable or failed"
    return NodeError(status, upstream_error(status, f"{node.role} node {node.url} {what}: {exc or type(exc).__name__}"),
                     node.url, retryable=not timed_out)
