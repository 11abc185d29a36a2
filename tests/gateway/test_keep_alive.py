"""An idle client connection outlives the HTTP clients' own pool expiry.

uvicorn's default closes an idle connection after 5 s, exactly when httpx's pool (keepalive_expiry
5 s) may still hand it out: the next request on it then fails as a ReadError before the gateway
reads it, so it is never recorded (the 30-minute soak lost an agent process to one). Measured on
a real socket: a control gateway with a 1 s keep-alive closes the idle connection, the default
one still answers on it after longer than httpx keeps a connection.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from lightning_middleware import TraceStore
from lightning_middleware.gateway import Gateway

HEALTH = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
HTTPX_KEEPALIVE_EXPIRY_S = 5.0


def _answer(sock: socket.socket) -> bytes:
    """What the gateway sends back to one request, b"" if it had closed the connection."""
    try:
        sock.sendall(HEALTH)
        return sock.recv(65536)
    except (BrokenPipeError, ConnectionResetError):
        return b""


def idle_then_ask(port: int, idle_s: float) -> tuple[bytes, bytes]:
    """Two GET /health on one connection, `idle_s` apart: the answers (b"" once it was closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        first = _answer(sock)
        time.sleep(idle_s)
        return first, _answer(sock)


def test_idle_connections_stay_open_longer_than_clients_keep_them(tmp_path: Path) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'gw.db'}")
    try:
        with Gateway(["http://127.0.0.1:1/v1"], store, health_interval_s=0, keep_alive_s=1) as short:
            first, after_idle = idle_then_ask(short.port, 1.6)
        assert first.startswith(b"HTTP/1.1 200"), first
        assert after_idle == b"", "control: a 1 s keep-alive should have closed the idle connection"

        with Gateway(["http://127.0.0.1:1/v1"], store, health_interval_s=0) as gw:
            assert gw.keep_alive_s > HTTPX_KEEPALIVE_EXPIRY_S
            first, after_idle = idle_then_ask(gw.port, HTTPX_KEEPALIVE_EXPIRY_S + 1.0)
        assert first.startswith(b"HTTP/1.1 200"), first
        assert after_idle.startswith(b"HTTP/1.1 200"), after_idle
    finally:
        store.close()
