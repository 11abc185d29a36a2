"""A minimal ASGI client for driving the gateway's app in process with exactly the bytes a test
chooses: any path (dot segments, percent-encoded slashes, unicode), any header bytes (CR/LF,
NUL, oversized), a body in any number of chunks. httpx's ASGI transport normalises and
validates those on the way, so it cannot send what a fuzz test needs to send.

It behaves as a server would: after the body it holds `receive()` until the response is
complete, then reports the client gone (a streamed answer is not cut short).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_middleware.asgi.replies import Message

LOOPBACK = ("127.0.0.1", 50000)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    def error(self) -> dict[str, Any]:
        """The OpenAI-style error object the gateway answers with (asserts it is one)."""
        assert (self.header(b"content-type") or b"").startswith(b"application/json"), (self.status, self.body[:300])
        payload = json.loads(self.body)
        assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
        assert isinstance(payload["error"].get("message"), str) and payload["error"]["message"], payload
        return payload["error"]


def scope(method: str, path: str, headers: Sequence[tuple[bytes, bytes]], raw_path: bytes | None = None,
          client: tuple[str, int] = LOOPBACK) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path,
            "raw_path": raw_path if raw_path is not None else path.encode("utf-8", "surrogatepass"),
            "query_string": b"", "root_path": "", "headers": list(headers), "client": client,
            "server": ("127.0.0.1", 8090)}


async def request(app: Any, method: str, path: str, *, headers: Sequence[tuple[bytes, bytes]] = (),
                  chunks: Sequence[bytes] = (b"",), raw_path: bytes | None = None,
                  client: tuple[str, int] = LOOPBACK, timeout: float = 30.0) -> Answer:
    """Send one request to `app` and collect its whole answer."""
    pending: list[Message] = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                              for i, c in enumerate(chunks or (b"",))]
    finished = asyncio.Event()
    start: dict[str, Any] = {}
    body: list[bytes] = []

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    await asyncio.wait_for(app(scope(method, path, headers, raw_path, client), receive, send), timeout)
    finished.set()
    assert start, "the app sent no response"
    return Answer(start["status"], list(start.get("headers", [])), b"".join(body))
