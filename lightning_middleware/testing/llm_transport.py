"""The deterministic test LLM as an in-process transport: the same answers as `LLMTestServer`,
with no socket and no subprocess.

    client = OpenAI(base_url=TEST_BASE_URL, api_key="-", http_client=llm_http_client(httpx2))
    llm = ChatOpenAI(base_url=TEST_BASE_URL, api_key="-", http_client=llm_http_client(httpx),
                     http_async_client=llm_http_client(httpx, asynchronous=True))

One class serves both the sync and the async API, for `httpx` and `httpx2` (openai 3.x): each
module has its own transport base classes and `Response` type, so the transport is built for
the module it is given. Streams are real streams: SSE events are yielded one by one (with the
`x-test-delay` pause between them), so a reader that stops early sees a partial stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import httpx

from lightning_middleware.testing.llm_script import MODELS, reply, tokenize_reply

TEST_BASE_URL = "http://llm.test/v1"  # any URL works: nothing is resolved or connected


class _Body:
    """A response body as a real network body: chunks yielded as they come (SSE events `delay_s`
    apart), never pre-read, so a recording transport sees it exactly as from a socket."""

    def __init__(self, chunks: tuple[bytes, ...], delay_s: float = 0.0) -> None:
        self._chunks, self._delay_s = chunks, delay_s

    def _take(self) -> tuple[bytes, ...]:
        """The chunks, once: like a socket's body, a second read (openai drains a finished
        stream) finds nothing left."""
        chunks, self._chunks = self._chunks, ()
        return chunks

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._take():
            if self._delay_s:
                time.sleep(self._delay_s)
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._take():
            if self._delay_s:
                await asyncio.sleep(self._delay_s)
            yield chunk



_JSON = {"content-type": "application/json"}


def _answer(request: Any) -> tuple[int, dict[str, str], _Body]:
    """(status, headers, body) for a request of either module."""
    path = request.url.path
    if request.method == "GET" and path.endswith("/models"):
        return 200, _JSON, _Body((_json(MODELS),))
    if request.method == "GET" and path.endswith("/health"):
        return 200, _JSON, _Body((b'{"ok": true}',))
    if request.method == "POST" and path.endswith("/tokenize"):
        return 200, _JSON, _Body((_json(tokenize_reply(request.content)),))
    if request.method != "POST" or not path.endswith(("/chat/completions", "/completions", "/responses")):
        return 404, _JSON, _Body((b'{"detail": "Not Found"}',))
    headers = {k.lower(): v for k, v in request.headers.items()}
    answer = reply(path, headers, request.content)
    if answer.stream:
        return answer.status, {"content-type": "text/event-stream", **answer.headers}, _Body(answer.events,
                                                                                          answer.delay_s)
    return answer.status, {**_JSON, **answer.headers}, _Body((answer.json_bytes(),))


def _json(value: Any) -> bytes:
    import json

    return json.dumps(value).encode()


def transport_class(module: ModuleType = httpx) -> type:
    """The transport class for `module` (httpx or httpx2), sync and async in one; built once."""
    if module.__name__ not in _CLASSES:
        _CLASSES[module.__name__] = _build_class(module)
    return _CLASSES[module.__name__]


_CLASSES: dict[str, type] = {}


def _build_class(module: ModuleType) -> type:
    class SyncStream(module.SyncByteStream):  # type: ignore[name-defined]
        def __init__(self, body: _Body) -> None:
            self._body = body

        def __iter__(self) -> Iterator[bytes]:
            return iter(self._body)

    class AsyncStream(module.AsyncByteStream):  # type: ignore[name-defined]
        def __init__(self, body: _Body) -> None:
            self._body = body

        def __aiter__(self) -> AsyncIterator[bytes]:
            return self._body.__aiter__()

    class LLMTestTransport(module.BaseTransport, module.AsyncBaseTransport):  # type: ignore[name-defined]
        """Answers every request with the deterministic test LLM, in this process."""

        def __init__(self) -> None:
            self.requests = 0

        def _respond(self, request: Any, stream: type) -> Any:
            self.requests += 1
            status, headers, body = _answer(request)
            return module.Response(status, headers=headers, stream=stream(body), request=request)

        def handle_request(self, request: Any) -> Any:
            request.read()
            return self._respond(request, SyncStream)

        async def handle_async_request(self, request: Any) -> Any:
            await request.aread()
            return self._respond(request, AsyncStream)

    return LLMTestTransport


def llm_transport(module: ModuleType = httpx) -> Any:
    """A new in-process test-LLM transport for `module`'s clients (httpx or httpx2)."""
    return transport_class(module)()


def llm_http_client(module: ModuleType = httpx, *, asynchronous: bool = False, **kwargs: Any) -> Any:
    """An httpx/httpx2 client (async with `asynchronous=True`) that talks to the test LLM in-process."""
    cls = module.AsyncClient if asynchronous else module.Client
    return cls(transport=llm_transport(module), **kwargs)
