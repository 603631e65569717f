"""Run an ASGI app with uvicorn so that SIGTERM / SIGINT mean a graceful stop and exit status 0."""

from __future__ import annotations

import uvicorn


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises the stop signal after its graceful shutdown, so the process would die by
    SIGTERM (status -15). A stop asked for is a clean exit here: the signal is handled, not replayed."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve_app(app, host: str, port: int, log_level: str = "info", graceful_timeout: float = 5.0) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout)
    _GracefulServer(config).run()
