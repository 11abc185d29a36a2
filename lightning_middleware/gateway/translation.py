"""The gateway's side of format translation: `POST /v1/responses` and `POST /v1/messages` are sent
to the replica as chat completions (so vLLM returns token IDs), recorded as such with the caller's
request beside it, and answered in the caller's format, streams event by event as vLLM produces
them (`lightning_middleware.formats`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from lightning_middleware import fastjson
from lightning_middleware.asgi.error_replies import HTTPError
from lightning_middleware.asgi.replies import Full
from lightning_middleware.capture import Source
from lightning_middleware.formats import Format, TranslationError, store_history
from lightning_middleware.store import TraceStore


@dataclass(frozen=True)
class TranslatedCall:
    """A caller's request and the chat-completions request it is sent as."""

    fmt: Format
    request: dict[str, Any]  # the caller's
    chat: dict[str, Any]
    body: bytes  # `chat`, serialised

    @property
    def source(self) -> Source:
        return Source(self.fmt.name, self.request)

    def answer(self, status: int, body: bytes, call_id: str) -> bytes:
        """A whole upstream body (2xx or 4xx) in the caller's format."""
        if 200 <= status < 300:
            return self.fmt.answer_body(body, self.request, call_id)
        return self.fmt.error_body(status, body)

    def stream(self, chunks: AsyncIterator[bytes], raw: list[bytes], call_id: str) -> AsyncIterator[bytes]:
        """The caller's events for an upstream chat stream, as its chunks arrive; the upstream's
        own chunks are kept in `raw` (the record is built from what the engine sent)."""
        return _translated(chunks, self.fmt.stream_rewriter(self.request, call_id), raw)

    def events(self, sse: bytes, call_id: str) -> bytes:
        """A whole upstream chat stream (a replayed record's) as the caller's events."""
        rewriter = self.fmt.stream_rewriter(self.request, call_id)
        return (rewriter.feed(sse) or b"") + (rewriter.finish() or b"")


async def _translated(chunks: AsyncIterator[bytes], rewriter: Any, raw: list[bytes]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        raw.append(chunk)
        out = rewriter.feed(chunk)
        if out:
            yield out
    tail = rewriter.finish()
    if tail:
        yield tail


async def translate_call(fmt: Format, payload: dict[str, Any], store: TraceStore) -> TranslatedCall:
    """The chat-completions request for a caller's request; a 4xx `HTTPError` naming the field if
    it cannot be translated faithfully."""
    history = store_history(store)
    try:
        if payload.get("previous_response_id") is not None:  # a store read: off the event loop
            chat = await asyncio.to_thread(fmt.to_chat, payload, history)
        else:
            chat = fmt.to_chat(payload, history)
    except TranslationError as exc:
        raise HTTPError(exc.status, str(exc), code=exc.code, param=exc.field) from None
    return TranslatedCall(fmt, payload, chat, orjson.dumps(chat))


def in_format(fmt: Format, reply: Full) -> Full:
    """A gateway error answer (OpenAI-shaped JSON) in the caller's format."""
    try:
        err = fastjson.loads(reply.body)["error"]
        body = fmt.error(reply.status, str(err["message"]), str(err.get("type")), err.get("param"))
    except (ValueError, KeyError, TypeError):
        return reply
    return Full(reply.status, reply.headers, orjson.dumps(body))
