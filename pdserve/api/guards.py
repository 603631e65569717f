"""Admission guards shared by nodes and the proxy: API key, request body size, bounded queue."""

from __future__ import annotations

import hmac
import json
import os

API_KEY_ENV = "PDSERVE_API_KEY"
OPEN_PATHS = ("/health", "/metrics", "/v1/kv/meta")  # kv/meta is keyed by an unguessable request id
# The proxy's live page and its feed: timings and node load, as open as /metrics (no prompt, no answer)
OPEN_PREFIXES = ("/dashboard",)
DEFAULT_MAX_BODY_BYTES = 4 << 20


def resolve_api_key(api_key: str | None) -> str | None:
    return api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)


class GuardMiddleware:
    """ASGI middleware: `Authorization: Bearer <key>` on the API (401), and a body size cap (413).
    Refusals use OpenAI's error body; nothing reaches the app for a refused request."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["path"].startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _refuse(send, 401, "invalid or missing API key (Authorization: Bearer <key>)",
                                     "authentication_error")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _refuse(send, 413, f"request body of {int(length)} bytes exceeds {self.max_body_bytes}")
        seen = 0

        async def capped_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:  # chunked bodies carry no length up front
                    raise BodyTooLarge
            return message

        try:
            return await self.app(scope, capped_receive, send)
        except BodyTooLarge:
            return await _refuse(send, 413, f"request body exceeds {self.max_body_bytes} bytes")


class BodyTooLarge(Exception):
    pass


async def _refuse(send, status: int, message: str, type_: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def overloaded(waiting: int, max_waiting: int | None) -> bool:
    return max_waiting is not None and waiting >= max_waiting


RETRY_AFTER_S = 1
