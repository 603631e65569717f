"""Serving helpers: uvicorn with SIGTERM / SIGINT as a graceful stop (exit status 0), and
noticing a client that leaves while its request is still being worked on."""

from __future__ import annotations

import asyncio
import threading

import uvicorn
from starlette.requests import Request

DISCONNECT_POLL_S = 0.5
# Set once the server is asked to stop: endless streams (the dashboard's feed) end by themselves
# rather than holding the graceful shutdown until its timeout.
STOPPING = threading.Event()


async def finished_before_disconnect(raw: Request, task: asyncio.Future) -> bool:
    """Wait for `task`; if the client disconnects first, cancel it (waiting until it has unwound,
    so whatever it held is released) and return False."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return True
        if await raw.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises the stop signal after its graceful shutdown, so the process would die by
    SIGTERM (status -15). A stop asked for is a clean exit here: the signal is handled, not replayed."""

    def handle_exit(self, sig, frame) -> None:
        STOPPING.set()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


# How long an idle client connection stays open. uvicorn's default, 5 s, is httpx's pool expiry too:
# a client that reused its pooled connection after 5 s idle raced the server closing it, and the
# request was lost (ReadError, no answer). Longer than common clients' pool expiry (httpx 5 s,
# aiohttp 15 s, the proxy's own NodeClient 30 s), so that the client closes first (nginx's default).
KEEP_ALIVE_S = 75


def serve_app(app, host: str, port: int, log_level: str = "info", graceful_timeout: float = 5.0) -> None:
    """Serve `app` until SIGTERM / SIGINT, on uvloop and httptools where installed (pdserve's
    dependencies): the proxy relays every streamed token, and its CPU lands on the nodes' cores."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                            timeout_keep_alive=KEEP_ALIVE_S)
    _GracefulServer(config).run()
