"""Giving the caller the answer it asked for: the fields only capture's injected request fields
produced (`return_token_ids`, `logprobs`) are removed from the caller's copy of a JSON body or an
event stream, as it passes through the recording transport.

The server's bytes can be anything: what cannot be parsed, or written back, reaches the caller
untouched; nothing here raises into the caller.
"""

from __future__ import annotations

from typing import Any

import orjson

from lightning_middleware import fastjson


def strip_added(obj: dict[str, Any], added: frozenset[str]) -> None:
    """Remove from a response (or stream chunk) the fields only our injected request fields produced."""
    if "return_token_ids" in added:
        obj.pop("prompt_token_ids", None)
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():  # the server's JSON: any shape
        if not isinstance(choice, dict):
            continue
        if "return_token_ids" in added:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if "logprobs" in added and "logprobs" in choice:
            choice["logprobs"] = None  # what the API sends when logprobs were not asked for


class BodyRewriter:
    """Buffers a JSON body and hands it back without the injected fields.

    The caller's SDK reads the whole body before parsing it anyway, so holding
    it costs no latency, and the SDK no longer parses per-token logprobs it
    never asked for (the largest part of what asking for them costs a caller).
    """

    def __init__(self, added: frozenset[str]) -> None:
        self._added = added
        self._parts: list[bytes] = []

    def feed(self, data: bytes) -> bytes:
        self._parts.append(data)
        return b""

    def finish(self) -> bytes:
        raw = b"".join(self._parts)
        try:
            body = fastjson.loads(raw)
        except ValueError:
            return raw
        if not isinstance(body, dict):
            return raw
        strip_added(body, self._added)
        return _dumps(body) or raw


class EventRewriter:
    """Rewrites a server-sent event stream event by event, as the events arrive."""

    def __init__(self, added: frozenset[str]) -> None:
        self._added = added
        self._pending = b""
        self._passthrough = False

    def feed(self, data: bytes) -> bytes:
        if self._passthrough or b"\r" in data:  # CRLF framing: pass it on untouched, never hold it back
            self._passthrough = True
            out, self._pending = self._pending + data, b""
            return out
        self._pending += data
        head, sep, rest = self._pending.rpartition(b"\n\n")
        if not sep:
            return b""
        self._pending = rest
        return b"".join(self._event(e) for e in head.split(b"\n\n"))

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data: {"):
            try:
                chunk = fastjson.loads(event[6:])
            except ValueError:
                return event + b"\n\n"
            strip_added(chunk, self._added)
            out = _dumps(chunk)
            if out is not None:  # whitespace after the JSON (an odd blank line) is the server's: kept
                return b"data: " + out + event[len(event.rstrip()):] + b"\n\n"
        return event + b"\n\n"

    def finish(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest


def _dumps(obj: dict[str, Any]) -> bytes | None:
    """`obj` as JSON for the caller, or None where orjson cannot write it back (nesting past its
    254 levels): then the caller gets the server's bytes untouched, never a stand-in."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return None
