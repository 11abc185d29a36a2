"""What the format translators share: the error an untranslatable request gets, text content in
chat form, SSE framing, the chat-completions stream read step by step, and whole-body buffering.

Both rewriters here (`ChatStream`, `Buffered`) have the shape the capture transport's tee and
the gateway's relay use: `feed(bytes) -> bytes` as the upstream's bytes arrive, `finish() ->
bytes` once they end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

log = logging.getLogger(__name__)

# previous_response_id -> the chat messages of that conversation so far (raises TranslationError).
History = Callable[[str], list[dict[str, Any]]]


class TranslationError(ValueError):
    """A request that cannot be translated faithfully: the caller gets `status` (a 4xx) with a
    message that names the field, instead of a request the engine would answer differently."""

    def __init__(self, field: str, message: str, *, status: int = 400, code: str = "unsupported_field") -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.status, self.code = field, status, code


def unsupported(field: str, what: str) -> TranslationError:
    return TranslationError(field, f"{what} cannot be translated to chat completions faithfully, so it is "
                                   "refused rather than dropped (docs/formats.md)")


def invalid(field: str, message: str) -> TranslationError:
    return TranslationError(field, message, code="invalid_request")


def text_content(parts: list[str]) -> str | list[dict[str, str]] | None:
    """Text blocks as chat content: one block as a string, several as text parts (vLLM joins
    them as it joins any chat content parts), none as None."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return [{"type": "text", "text": p} for p in parts]


def as_list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(field, "must be a list")
    return value


def as_dict(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(field, "must be an object")
    return value


def as_str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise invalid(field, "must be a string")
    return value


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event, named as the caller's SDK dispatches on it."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def first_message(chat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(choice 0, its message) of a chat-completions answer ({} where absent)."""
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    return choice, message if isinstance(message, dict) else {}


def tool_calls_of(message: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each tool call of a chat message."""
    out = []
    for tc in message.get("tool_calls") or ():
        if isinstance(tc, dict):
            fn = tc.get("function") or {}
            out.append((str(tc.get("id") or ""), str(fn.get("name") or ""), str(fn.get("arguments") or "")))
    return out


def chat_error_message(raw: bytes) -> tuple[str, str]:
    """(message, type) of an upstream error body, whatever its shape."""
    try:
        body = orjson.loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace"), "api_error"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err), str(err.get("type") or "api_error")
    if isinstance(body, dict) and "detail" in body:  # a framework's own 4xx shape
        return str(body["detail"]), "invalid_request_error"
    return str(err or body)[:500], "api_error"


class StreamHandler:
    """A format's side of a translated stream: `ChatStream` calls these as the chat stream's
    choice 0 unfolds; each appends the caller's events to `out`."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def take(self) -> bytes:
        if not self.out:
            return b""
        data = b"".join(self.out)
        self.out.clear()
        return data

    def start(self, chunk: dict[str, Any]) -> None: ...
    def text(self, delta: str) -> None: ...
    def tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None: ...
    def tokens(self, n: int) -> None: ...
    def usage(self, usage: dict[str, Any]) -> None: ...
    def finish(self, reason: str, stop_reason: Any) -> None: ...
    def close(self) -> None: ...
    def fail(self, message: str) -> None: ...


class ChatStream:
    """Reads a chat-completions SSE stream as it arrives and drives a `StreamHandler`: each
    `feed` returns the caller's events for the chat events complete so far, so the caller's
    stream advances with the engine's, never buffered to the end."""

    def __init__(self, handler: StreamHandler) -> None:
        self.handler = handler
        self._pending = b""
        self._started = False
        self._closed = False

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        if b"\n" not in data:
            return b""
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                self._data(line[5:].strip())
        return self.handler.take()

    def finish(self) -> bytes:
        tail, self._pending = self._pending.strip(), b""
        if tail.startswith(b"data:"):
            self._data(tail[5:].strip())
        self._close()
        return self.handler.take()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.handler.close()

    def _data(self, payload: bytes) -> None:
        if self._closed:
            return
        if payload == b"[DONE]":
            self._close()
            return
        try:
            chunk = orjson.loads(payload)
        except ValueError:
            log.warning("an unparseable chat stream chunk was not translated")
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk and "choices" not in chunk:
            self._closed = True
            self.handler.fail(chat_error_message(payload)[0])
            return
        h = self.handler
        if not self._started:
            self._started = True
            h.start(chunk)
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:  # n > 1 is refused: one choice
                self._choice(choice)
        if chunk.get("usage"):
            h.usage(chunk["usage"])

    def _choice(self, choice: dict[str, Any]) -> None:
        h = self.handler
        ids = choice.get("token_ids")
        if ids:
            h.tokens(len(ids))
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content"):
                h.text(delta["content"])
            for tc in delta.get("tool_calls") or ():
                fn = tc.get("function") or {}
                h.tool(int(tc.get("index") or 0), tc.get("id"), fn.get("name"), fn.get("arguments") or "")
        if choice.get("finish_reason"):
            h.finish(choice["finish_reason"], choice.get("stop_reason"))


class Buffered:
    """Buffers a whole body and hands back `convert(body)` at the end (the caller's SDK reads a
    whole body before parsing it anyway, so holding it costs the caller nothing)."""

    def __init__(self, convert: Callable[[bytes], bytes]) -> None:
        self._convert = convert
        self._parts: list[bytes] = []

    def feed(self, data: bytes) -> bytes:
        self._parts.append(data)
        return b""

    def finish(self) -> bytes:
        return self._convert(b"".join(self._parts))


@dataclass(frozen=True)
class Format:
    """One caller format translated to chat completions and back (a module of this package each)."""

    name: str  # the record's `source_format`
    route: str  # the path the caller posts to after `/v1/`: "responses", "messages"
    suffix: str  # how such a path ends: "/responses"; "/v1/messages" (the Assistants API has .../messages)
    vendor_hosts: frozenset[str]  # hosts that speak the format themselves: `wrap()` leaves them alone
    to_chat: Callable[[dict[str, Any], History | None], dict[str, Any]]  # raises TranslationError
    answer: Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]]  # (chat answer, request, call id)
    stream_handler: Callable[[dict[str, Any], str], StreamHandler]  # (request, call id)
    error: Callable[[int, str, str, str | None], dict[str, Any]]  # (status, message, type, field)

    def body_rewriter(self, source: dict[str, Any], call_id: str) -> Buffered:
        """The caller's whole answer from the engine's chat-completions body."""
        return Buffered(lambda raw: self.answer_body(raw, source, call_id))

    def stream_rewriter(self, source: dict[str, Any], call_id: str) -> ChatStream:
        """The caller's event stream from the engine's chat-completions stream, event by event."""
        return ChatStream(self.stream_handler(source, call_id))

    def error_rewriter(self, status: int) -> Buffered:
        """An upstream error body in the caller's format."""
        return Buffered(lambda raw: self.error_body(status, raw))

    def answer_body(self, raw: bytes, source: dict[str, Any], call_id: str) -> bytes:
        """The caller's answer for a chat-completions body; one that is not a JSON object passes unchanged."""
        try:
            chat = orjson.loads(raw)
        except ValueError:
            return raw
        return orjson.dumps(self.answer(chat, source, call_id)) if isinstance(chat, dict) else raw

    def error_body(self, status: int, raw: bytes) -> bytes:
        message, kind = chat_error_message(raw)
        return orjson.dumps(self.error(status, message, kind, None))

    def refusal_body(self, exc: TranslationError) -> bytes:
        """The 4xx body of a request that cannot be translated."""
        return orjson.dumps(self.error(exc.status, str(exc), "invalid_request_error", exc.field))
