"""wrap()'s side of format translation: a Responses API or Anthropic Messages request bound for a
chat-completions server leaves as a chat-completions request (to the `chat/completions` path
beside the caller's), is recorded as one, and its answer is rewritten back on the way in.

Translation happens whether or not the call is recorded: the server speaks only chat completions,
so an untranslated request would fail. A request that cannot be translated faithfully is answered
here with a 4xx naming the field and never leaves the process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from lightning_middleware import fastjson
from lightning_middleware.capture.calls import CaptureSettings, PendingCall, Source, begin_request, request_state
from lightning_middleware.formats import Format, TranslationError, chat_path, format_for_path, store_history
from lightning_middleware.records import new_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Translation:
    """A request sent translated: how to turn the engine's answer back into the caller's."""

    fmt: Format
    source: dict[str, Any]  # the caller's request
    call_id: str  # the record's id (the answer's `resp_`/`msg_` id)

    def rewriter(self, status: int, content_type: str) -> Any:
        """What rewrites the answer's body for the caller (the tee's feed/finish protocol)."""
        if not 200 <= status < 300:
            return self.fmt.error_rewriter(status)
        if "text/event-stream" in content_type:
            return self.fmt.stream_rewriter(self.source, self.call_id)
        return self.fmt.body_rewriter(self.source, self.call_id)


@dataclass(frozen=True)
class Outgoing:
    """What capture made of a request before it is sent."""

    pending: PendingCall | None = None  # recorded (None: sent unrecorded)
    body: bytes | None = None  # the body to send instead of the caller's (None: unchanged)
    translation: Translation | None = None  # sent translated (the request's URL now names chat/completions)
    refusal: tuple[int, bytes] | None = None  # answer this (status, JSON body) instead of sending


def format_to_translate(settings: CaptureSettings, request: Any) -> Format | None:
    """The format `request` is translated from, or None (not one, or translation is off for it)."""
    if request.method != "POST" or settings.translate is False:
        return None
    fmt = format_for_path(request.url.path)
    if fmt is None or (settings.translate is None and request.url.host in fmt.vendor_hosts):
        return None
    return fmt


def translate_outgoing(settings: CaptureSettings, request: Any, body: bytes, fmt: Format) -> Outgoing:
    """Translate a request into chat completions and begin recording it (or refuse it)."""
    try:
        payload = fastjson.loads(body) if body else None
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return Outgoing(refusal=(400, fmt.refusal_body(TranslationError("body", "must be a JSON object",
                                                                        code="invalid_json"))))
    state = request_state(settings, request)
    try:
        chat = fmt.to_chat(payload, store_history(state.store if state is not None else settings.store))
    except TranslationError as exc:
        return Outgoing(refusal=(exc.status, fmt.refusal_body(exc)))
    chat_body = orjson.dumps(chat)
    request.url = request.url.copy_with(path=chat_path(request.url.path, fmt))
    try:
        pending, injected = begin_request(settings, request, chat_body, payload=chat,
                                          source=Source(fmt.name, payload))
    except Exception:  # recording failed: the translated call still goes out
        log.exception("capture failed before sending; forwarding a translated call unrecorded")
        pending, injected = None, None
    translation = Translation(fmt, payload, pending.call_id if pending is not None else new_id())
    return Outgoing(pending, injected or chat_body, translation)
