"""A real TCP proxy that loses answers: each request is passed to the target server on a
connection of its own; the answer to the first request whose path ends with `suffix` is read in
full and thrown away, and the client's connection is closed without it (the client sees the
server disconnect, as when a response is lost on the way back)."""

from __future__ import annotations

import contextlib
import socket
import threading


class DropFirstAnswerProxy:
    def __init__(self, target_port: int, suffix: str = "/reward") -> None:
        self.target_port, self.suffix = target_port, suffix
        self.dropped = 0
        self.passed = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.close()

    def __enter__(self) -> DropFirstAnswerProxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head, body = _read_request(conn)
            if not head:
                return
            path = head.split(b" ", 2)[1].decode()
            lines = [line for line in head.split(b"\r\n")[1:] if not line.lower().startswith(b"connection:")]
            request = b"\r\n".join([head.split(b"\r\n")[0], *lines, b"Connection: close", b"", b""]) + body
            with socket.create_connection(("127.0.0.1", self.target_port)) as up:
                up.sendall(request)
                answer = _read_all(up)
            with self._lock:
                drop = path.endswith(self.suffix) and not self.dropped
                self.dropped += drop
                self.passed += not drop
            if not drop:
                conn.sendall(answer)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _read_request(conn: socket.socket) -> tuple[bytes, bytes]:
    """(the request line and headers, the body by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head, body


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out
