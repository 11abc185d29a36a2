"""Raw ASGI responses: a whole body, or an upstream SSE stream relayed chunk by chunk.

The proxy path answers with these instead of a framework's Response objects: on a 2-core
machine every object built per call shows up in the latency a caller sees.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # aiohttp is imported when the gateway starts
    import aiohttp

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]  # ASGI form: lower-case names
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
# Hop-by-hop and recomputed headers of an upstream answer that are not passed on to the caller.
DROP_RESPONSE_HEADERS = frozenset({
    b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"date", b"server", b"content-encoding",
})


def reply_headers(raw: Iterable[tuple[bytes, bytes]]) -> Headers:
    """An upstream response's headers as passed on to the caller (ASGI form, hop-by-hop ones dropped)."""
    out = []
    for k, v in raw:
        k = k.lower()
        if k not in DROP_RESPONSE_HEADERS:
            out.append((k, v))
    return out


class Full:
    """A whole response, as an ASGI app."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [*self.headers, (b"content-length", str(len(self.body)).encode())]})
        await send({"type": "http.response.body", "body": self.body})


class StreamResponse:
    """An ASGI response that relays an upstream SSE stream chunk by chunk.

    Stops reading upstream (and closes that connection, so the engine stops generating)
    when the client goes away, and reports (complete, chunks relayed) exactly once when done.
    """

    def __init__(self, status: int, headers: Headers, first: bytes, chunks: AsyncIterator[bytes],
                 upstream: aiohttp.ClientResponse,
                 on_done: Callable[[bool, list[bytes]], None]) -> None:
        self.status, self.headers, self.first, self.chunks = status, headers, first, chunks
        self.upstream, self.on_done = upstream, on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        watcher = asyncio.create_task(watch())
        sent: list[bytes] = []
        complete = False
        try:
            await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
            if self.first:
                sent.append(self.first)
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.chunks:
                if gone.is_set():
                    break
                sent.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:
                complete = not gone.is_set()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:  # upstream died mid-stream: the caller sees the stream end early
            log.warning("stream from upstream ended with %s: %s", type(exc).__name__, exc)
        finally:
            watcher.cancel()
            if complete:
                self.upstream.release()
            else:
                self.upstream.close()
            self.on_done(complete, sent)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # accepted sockets inherit it; with proto 0 every response waits out Nagle + delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.set_inheritable(True)
    return sock
