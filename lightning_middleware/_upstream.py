"""The gateway's HTTP/1.1 connection to its upstreams: an httpx transport that sends through aiohttp.

Why: the gateway forwards every call through the one capture transport
(`capture.RecordingTransport`, the same as `wrap()` installs), which is an httpx transport.
Under it, httpx's default transport (httpcore + the pure-Python h11 parser) was the largest
single CPU cost per call in the gateway; aiohttp parses HTTP with llhttp in C and pools
connections cheaply. Only the bottom layer changes: requests, responses, streams and errors keep their httpx
types, so capture, streaming and the gateway's error mapping see no difference.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx

__all__ = ["AiohttpTransport"]


def _httpx_error(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx exception a httpcore-based transport would have raised for this failure."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)


class _ResponseStream(httpx.AsyncByteStream):
    """The body as it arrives (SSE events are relayed chunk by chunk), raw: httpx decodes."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _httpx_error(exc, self._request) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """`httpx.AsyncBaseTransport` over one `aiohttp.ClientSession` (created on first use, in the loop)."""

    def __init__(self, *, max_connections: int = 256) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0),
                auto_decompress=False,  # httpx decodes content-encoding, as with its own transport
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        try:
            response = await self._open().request(
                request.method, str(request.url),
                data=await request.aread(),
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout.get("connect"),
                                              sock_read=timeout.get("read")),
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _httpx_error(exc, request) from exc
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_ResponseStream(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"AiohttpTransport(max_connections={self._max_connections})"

