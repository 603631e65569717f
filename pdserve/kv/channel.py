"""The side-channel listener shared by P (serves pulls) and D (receives pushes)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
from typing import Callable

from pdserve.kv.protocol import Auth, AuthResult, Challenge, Message, ProtocolError, recv_msg, send_msg

logger = logging.getLogger(__name__)

SOCKET_BUFFER = 4 << 20
HANDSHAKE_TIMEOUT_S = 10.0


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


SECRET_ENV = "PDSERVE_KV_SECRET"


class AuthError(ProtocolError):
    pass


def resolve_secret(secret: str | None) -> bytes:
    """The cluster secret: --kv-secret, else $PDSERVE_KV_SECRET, else none (logged as insecure)."""
    value = secret if secret is not None else os.environ.get(SECRET_ENV, "")
    if not value:
        logger.warning("KV side channel has no shared secret: any local process can connect "
                       "(set --kv-secret or %s)", SECRET_ENV)
    return value.encode()


def _mac(secret: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(nonces), hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes, refused: Callable[[str], None] = lambda why: None) -> None:
    """Challenge the peer, check its proof, prove ourselves; AuthError if the peer fails.
    `refused(why)` runs before the peer is told, so that a refusal is on record once the peer knows."""
    nonce = secrets.token_bytes(32)
    send_msg(sock, Challenge(nonce))
    auth = recv_msg(sock)
    if not isinstance(auth, Auth) or not hmac.compare_digest(auth.mac, _mac(secret, b"client", nonce, auth.nonce)):
        why = "peer failed the shared-secret challenge"
        refused(why)
        send_msg(sock, AuthResult(ok=False, error="authentication failed"))
        raise AuthError(why)
    send_msg(sock, AuthResult(ok=True, mac=_mac(secret, b"server", auth.nonce, nonce)))


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Answer the server's challenge and check that the server holds the secret too."""
    challenge = recv_msg(sock)
    if not isinstance(challenge, Challenge):
        raise ProtocolError(f"expected a challenge, got {type(challenge).__name__}")
    nonce = secrets.token_bytes(32)
    send_msg(sock, Auth(_mac(secret, b"client", challenge.nonce, nonce), nonce))
    result = recv_msg(sock)
    if not isinstance(result, AuthResult) or not result.ok:
        raise AuthError(getattr(result, "error", None) or "the peer refused our credentials (wrong --kv-secret?)")
    if not hmac.compare_digest(result.mac, _mac(secret, b"server", nonce, challenge.nonce)):
        raise AuthError("the peer could not prove it holds the shared secret")


def connect(host: str, port: int, timeout_s: float, secret: bytes) -> socket.socket:
    """An authenticated side-channel connection (closed again if the handshake fails)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        tune_socket(sock)
        client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return sock


class SideChannelServer:
    """Accepts connections on (host, port) and serves each on its own thread: the first message
    must be of an `opening` type, then `handle(conn, message)` owns the connection."""

    def __init__(self, host: str, port: int, name: str, opening: type | tuple[type, ...],
                 handle: Callable[[socket.socket, Message], None], secret: bytes = b""):
        self.name, self.opening, self.handle, self.secret = name, opening, handle, secret
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
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                try:
                    server_handshake(conn, self.secret, lambda why: logger.warning(
                        "%s: refused connection from %s: %s", self.name, addr, why))
                except AuthError:
                    return
                conn.settimeout(None)
                msg = recv_msg(conn)
                if not isinstance(msg, self.opening):
                    raise ProtocolError(f"unexpected opening message {type(msg).__name__}")
                self.handle(conn, msg)
            except (OSError, ProtocolError) as exc:
                logger.warning("%s: connection from %s failed: %s", self.name, addr, exc)

    def close(self) -> None:
        self.server.close()
