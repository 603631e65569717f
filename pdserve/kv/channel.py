"""The side-channel listener shared by P (serves pulls) and D (receives pushes)."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from pdserve.kv.protocol import Message, ProtocolError, recv_msg

logger = logging.getLogger(__name__)

SOCKET_BUFFER = 4 << 20


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


class SideChannelServer:
    """Accepts connections on (host, port) and serves each on its own thread: the first message
    must be of `opening` type, then `handle(conn, message)` owns the connection."""

    def __init__(self, host: str, port: int, name: str, opening: type, handle: Callable[[socket.socket, Message], None]):
        self.name, self.opening, self.handle = name, opening, handle
        self.server = socket.create_server((host, port), backlog=128)
        self.host, self.port = host, self.server.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=name, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self.server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn, addr), name=f"{self.name}-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        with conn:
            try:
                tune_socket(conn)
                msg = recv_msg(conn)
                if not isinstance(msg, self.opening):
                    raise ProtocolError(f"expected {self.opening.__name__}, got {type(msg).__name__}")
                self.handle(conn, msg)
            except (OSError, ProtocolError) as exc:
                logger.warning("%s: connection from %s failed: %s", self.name, addr, exc)

    def close(self) -> None:
        self.server.close()
