"""The capture transport: one recording mechanism for every framework.

Every supported framework sends its LLM requests through an httpx-style client
(`httpx`, or `httpx2` for openai 3.x). `install()` puts a `RecordingTransport`
in front of that client's transport. For each chat/completions request it:

1. adds `return_token_ids: true` (and `logprobs: true` for training rollouts)
   unless the caller set them, asks for an uncompressed body, and removes our
   routing headers (`x-rollout-id`, `x-agent-name`);
2. forwards the request, and hands back the response with its body stream
   teed: bytes flow to the caller as they arrive and are kept aside;
3. when the body ends or is closed, hands the attempt to the store's
   background writer, whose thread parses the kept bytes into one `LLMCall`
   (text, tool calls, token IDs, logprobs, finish reason). The agent's thread
   pays for an append per chunk, never for parsing or disk, and nothing here
   raises into the agent.

If a server rejects the extra fields with a 400, the request is resent once as
the caller wrote it and injection stops for that host: recording must never be
why an agent's call fails.

Responses API and Anthropic Messages requests bound for a chat-completions server
are translated first (`capture/translation.py`): they leave as chat completions,
are recorded as such, and the body handed back is rewritten into the caller's format.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

from lightning_middleware.capture.calls import ROUTING_HEADERS, CaptureSettings, PendingCall, begin_request
from lightning_middleware.capture.rewriting import BodyRewriter, EventRewriter
from lightning_middleware.capture.translation import Outgoing, format_to_translate, translate_outgoing

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Transports, built once per HTTP module (httpx, httpx2): same shapes, different classes.
# --------------------------------------------------------------------------

@functools.cache
def transport_classes(module: types.ModuleType) -> tuple[type[Any], type[Any]]:
    """(sync transport class, async transport class) for an httpx-like module."""

    class TeeStream(module.SyncByteStream):  # type: ignore[name-defined]
        """Passes the body on as it arrives, keeping each original chunk for the record.

        With a rewriter, what the caller gets has our injected fields removed.
        """

        def __init__(self, inner: Any, chunks: list[bytes], on_close: Any, rewriter: Any) -> None:
            self._inner, self._chunks, self._on_close, self._rw = inner, chunks, on_close, rewriter

        def __iter__(self) -> Iterator[bytes]:
            rw = self._rw
            try:
                for chunk in self._inner:
                    self._chunks.append(chunk)
                    out = chunk if rw is None else rw.feed(chunk)
                    if out:
                        yield out
                if rw is not None and (tail := rw.finish()):
                    yield tail
            finally:  # read to the end, or let go unclosed (an SDK that raised mid-stream): recorded now
                self._on_close()

        def close(self) -> None:
            try:
                self._inner.close()
            finally:
                self._on_close()

    class AsyncTeeStream(module.AsyncByteStream):  # type: ignore[name-defined]
        def __init__(self, inner: Any, chunks: list[bytes], on_close: Any, rewriter: Any) -> None:
            self._inner, self._chunks, self._on_close, self._rw = inner, chunks, on_close, rewriter

        async def __aiter__(self) -> AsyncIterator[bytes]:
            rw = self._rw
            try:
                async for chunk in self._inner:
                    self._chunks.append(chunk)
                    out = chunk if rw is None else rw.feed(chunk)
                    if out:
                        yield out
                if rw is not None and (tail := rw.finish()):
                    yield tail
            finally:  # as in TeeStream
                self._on_close()

        async def aclose(self) -> None:
            try:
                await self._inner.aclose()
            finally:
                self._on_close()

    def set_body(request: Any, body: bytes) -> None:
        request.stream = module.ByteStream(body)
        request._content = body
        request.headers["content-length"] = str(len(body))

    def prepare(request: Any, new_body: bytes | None) -> None:
        """Edit the outgoing request in place: cheaper than building a new one.

        The SDKs build a fresh request for every attempt, so nothing else sees it.
        """
        strip_routing_headers(request)
        request.headers["accept-encoding"] = "identity"  # so the tee sees plain bytes
        if new_body is not None:
            set_body(request, new_body)

    def start(settings: CaptureSettings, request: Any, body: bytes) -> Outgoing:
        """Begin recording `request` (translating it first if it speaks another format) and edit
        it for sending; an empty `Outgoing`: forward it unrecorded, as it is."""
        try:
            fmt = format_to_translate(settings, request)
            if fmt is not None:
                out = translate_outgoing(settings, request, body, fmt)
            else:
                pending, new_body = begin_request(settings, request, body)
                out = Outgoing(pending, new_body)
            if out.pending is not None or out.translation is not None:
                prepare(request, out.body)
            else:
                strip_routing_headers(request)
                if out.body is not None:  # unrecorded, but routed to its agent's policy
                    set_body(request, out.body)
            return out
        except Exception:
            log.exception("capture failed before sending; forwarding unrecorded")
            return Outgoing()

    def refuse(request: Any, refusal: tuple[int, bytes]) -> Any:
        """The answer to a request that cannot be translated: it never leaves the process."""
        status, body = refusal
        return module.Response(status, headers={"content-type": "application/json"}, content=body, request=request)

    def tee(response: Any, out: Outgoing, tee_cls: type, request: Any) -> Any:
        chunks: list[bytes] = []
        pending = out.pending

        def on_close() -> None:
            if pending is not None:
                pending.finish(status_code=response.status_code, chunks=chunks, headers=response.headers)

        try:
            if out.translation is not None:
                response.headers.pop("content-length", None)  # the caller's body is another one now
                rewriter = out.translation.rewriter(response.status_code, response.headers.get("content-type", ""))
            else:
                assert pending is not None
                rewriter = rewriter_for(response, pending)
            if response.is_closed:  # its body already read (a mock transport's Response(json=...)): no stream
                return already_read(response, request, chunks, on_close, rewriter)
            response.stream = tee_cls(response.stream, chunks, on_close, rewriter)
        except Exception as exc:  # hand back the untouched response rather than fail the call
            log.exception("could not tee a response; the call is recorded without its body")
            if pending is not None:
                pending.finish(status_code=response.status_code, headers=response.headers, error=f"recorder: {exc}")
        return response

    def already_read(response: Any, request: Any, chunks: list[bytes], on_close: Any, rewriter: Any) -> Any:
        """Record a response that came with its whole body, and hand the caller its body rewritten."""
        chunks.append(response.content)
        on_close()
        if rewriter is None:
            return response
        body = rewriter.feed(response.content) + (rewriter.finish() or b"")
        return module.Response(response.status_code, headers=response.headers, content=body,
                               request=request, extensions=response.extensions)

    def rewriter_for(response: Any, pending: PendingCall) -> Any:
        """What removes our injected fields from the caller's copy, if anything needs to."""
        if not (pending.added and pending.settings.strip_added and 200 <= response.status_code < 300):
            return None
        if response.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
            return None
        content_type = response.headers.get("content-type", "")
        if "text/event-stream" in content_type:
            return EventRewriter(pending.added)
        if "json" in content_type:
            response.headers.pop("content-length", None)  # the caller's body is shorter now
            return BodyRewriter(pending.added)
        return None

    def rejected_injection(pending: PendingCall, request: Any, response: Any) -> bool:
        """A 400 to a request we changed: resend it as the caller wrote it (`PendingCall.resent` then
        decides whether that host's requests stay unchanged)."""
        if not pending.rejected(response.status_code, request.url.host):
            return False
        set_body(request, pending.body)
        return True

    class RecordingTransport(module.BaseTransport):  # type: ignore[name-defined]
        def __init__(self, inner: Any, settings: CaptureSettings) -> None:
            self.inner = inner
            self.settings = settings

        def handle_request(self, request: Any) -> Any:
            out = start(self.settings, request, request.read())
            if out.refusal is not None:
                return refuse(request, out.refusal)
            pending = out.pending
            if pending is None and out.translation is None:
                return self.inner.handle_request(request)
            try:
                response = self.inner.handle_request(request)
                if pending is not None and rejected_injection(pending, request, response):
                    response.close()
                    response = self.inner.handle_request(request)
                    pending.resent(response.status_code, request.url.host)
            except Exception as exc:
                if pending is not None:
                    pending.finish(error=f"{type(exc).__name__}: {exc}")
                raise
            return tee(response, out, TeeStream, request)

        def close(self) -> None:
            self.inner.close()

    class AsyncRecordingTransport(module.AsyncBaseTransport):  # type: ignore[name-defined]
        def __init__(self, inner: Any, settings: CaptureSettings) -> None:
            self.inner = inner
            self.settings = settings

        async def handle_async_request(self, request: Any) -> Any:
            out = start(self.settings, request, await request.aread())
            if out.refusal is not None:
                return refuse(request, out.refusal)
            pending = out.pending
            if pending is None and out.translation is None:
                return await self.inner.handle_async_request(request)
            try:
                response = await self.inner.handle_async_request(request)
                if pending is not None and rejected_injection(pending, request, response):
                    await response.aclose()
                    response = await self.inner.handle_async_request(request)
                    pending.resent(response.status_code, request.url.host)
            except BaseException as exc:  # CancelledError too: the attempt is recorded as failed
                if pending is not None:
                    pending.finish(error=f"{type(exc).__name__}: {exc}")
                raise
            return tee(response, out, AsyncTeeStream, request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    return RecordingTransport, AsyncRecordingTransport


def strip_routing_headers(request: Any) -> None:
    """Our routing headers never leave the process."""
    for name in ROUTING_HEADERS:
        if name in request.headers:
            del request.headers[name]


# --------------------------------------------------------------------------
# Installing on an HTTP client
# --------------------------------------------------------------------------

def _http_module(client: Any) -> types.ModuleType | None:
    import sys

    for name in ("httpx2", "httpx"):
        mod = sys.modules.get(name)
        if mod is not None and isinstance(client, (mod.Client, mod.AsyncClient)):
            return mod
    return None


def is_http_client(obj: Any) -> bool:
    return _http_module(obj) is not None


def install(client: Any, settings: CaptureSettings) -> bool:
    """Put a recording transport in front of an httpx/httpx2 client's transports.

    Idempotent: an already-recording transport gets the new settings' store only
    if it was given explicitly (handled by the caller) and is otherwise left as
    it is. Returns True if something was installed now.
    """
    module = _http_module(client)
    if module is None:
        raise TypeError(f"not an httpx or httpx2 client: {type(client).__name__}")
    sync_cls, async_cls = transport_classes(module)
    cls = async_cls if isinstance(client, module.AsyncClient) else sync_cls
    installed = False
    current: Any = client._transport
    if isinstance(current, cls):
        current.settings = settings
    else:
        client._transport = cls(client._transport, settings)
        installed = True
    for pattern, mounted in list(client._mounts.items()):  # proxies: each mount is a transport too
        if mounted is None:
            continue
        if isinstance(mounted, cls):
            mounted_: Any = mounted
            mounted_.settings = settings
        else:
            client._mounts[pattern] = cls(mounted, settings)
            installed = True
    return installed


def installed_settings(client: Any) -> CaptureSettings | None:
    module = _http_module(client)
    if module is None:
        return None
    sync_cls, async_cls = transport_classes(module)
    t: Any = client._transport
    return t.settings if isinstance(t, (sync_cls, async_cls)) else None
