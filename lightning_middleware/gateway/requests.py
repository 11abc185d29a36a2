"""Reading requests off raw ASGI messages: the body within a size limit, JSON objects, and
which proxy route (and per-rollout base URL) a path is."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from lightning_middleware import fastjson
from lightning_middleware.asgi.error_replies import HTTPError
from lightning_middleware.asgi.replies import Receive

MAX_DEPTH = 1024  # JSON nesting orjson accepts; deeper bodies get a 400
# Rollout ids: safe in a URL path and a log line. Not only dots: "." and ".." are dot segments,
# which a client's URL handling removes from a per-rollout base URL (the calls would go unattached).
ID_RE = re.compile(r"(?!\.+\Z)[A-Za-z0-9._:\-]{1,64}\Z")
# RFC 9110: a field name is a token; a value is visible ASCII, space, tab and obs-text (0x80-0xff).
# The proxy passes the caller's headers on: CR/LF (header injection), NUL and other controls never go.
HEADER_NAME_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
HEADER_VALUE_RE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")


def is_rollout_id(value: object) -> bool:
    return isinstance(value, str) and ID_RE.match(value) is not None


def short_text(value: object, limit: int = 255) -> bool:
    """A string the store's short text columns hold on every database (PostgreSQL: no NUL, the
    column's length)."""
    return isinstance(value, str) and len(value) <= limit and "\x00" not in value


def check_headers(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    """A 431 for headers over `limit` bytes in all (uvicorn's httptools parser has no limit of its
    own), a 400 for a name that is no token or a value with control characters."""
    size = 0
    for name, value in headers:
        size += len(name) + len(value) + 4  # ": " and CRLF, as on the wire
        if not (HEADER_NAME_RE.fullmatch(name) and HEADER_VALUE_RE.fullmatch(value)):
            raise HTTPError(400, f"invalid header {name[:64]!r}: a name must be an HTTP token and a value must "
                            "not hold control characters (CR, LF, NUL, ...)", code="bad_header")
    if size > limit:
        raise HTTPError(431, f"request headers are {size} bytes; the limit is {limit}", code="headers_too_large")


async def receive_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    """The request body from raw ASGI messages, within `limit` bytes."""
    check_declared(headers.get("content-length"), limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(400, "the client went away while sending its request", code="client_disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def check_declared(declared: str | None, limit: int) -> None:
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise HTTPError(400, "bad Content-Length", code="bad_content_length") from None
    if size > limit:
        raise HTTPError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")


def parse_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from a request body, or a 400. JSON as RFC 8259 has it, which is what orjson
    reads: UTF-8 only, no NaN/Infinity, no lone surrogate (the store, PostgreSQL's json above all,
    could not keep the request as sent, and vLLM's reading of a NaN is anyone's guess)."""
    try:
        payload = fastjson.loads(raw)
    except ValueError as exc:
        payload = _beyond_orjson(raw, str(exc))
    if not isinstance(payload, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    return payload


def _beyond_orjson(raw: bytes, why: str) -> Any:
    """What orjson refused: a 400, except integers beyond 64 bits (older orjson refuses those; the
    standard library reads them, held to the same rules: strict UTF-8, no NaN/Infinity)."""
    if "depth limit" in why:  # orjson stops at 1024 levels; the stdlib would overflow the stack
        raise HTTPError(400, f"request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")
    if "64-bit" not in why:
        raise HTTPError(400, f"request body is not valid JSON: {why}", code="invalid_json")
    try:
        payload = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        json.dumps(payload, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape raises
        return payload
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# (path suffix, upstream path). Responses and Anthropic Messages are translated to chat completions
# (gateway/translation.py) unless the gateway runs with translate=False.
PROXY_SUFFIXES = (("/v1/chat/completions", "chat/completions"), ("/v1/completions", "completions"),
                  ("/v1/responses", "responses"), ("/v1/messages", "messages"))


def proxy_paths() -> list[str]:
    """Every path template the raw proxy handler serves (POST only), plain and per rollout."""
    return [path for suffix, _ in PROXY_SUFFIXES for path in (suffix, "/rollouts/{rid}" + suffix)]


def proxy_route(path: str) -> tuple[str, str | None] | None:
    """(upstream path, rollout id or None) for `/v1/...` and `/rollouts/{id}/v1/...` proxy routes."""
    for suffix, upstream_path in PROXY_SUFFIXES:
        if path.endswith(suffix):
            prefix = path[: -len(suffix)]
            if not prefix:
                return upstream_path, None
            rid = prefix[len("/rollouts/"):]
            if prefix.startswith("/rollouts/") and rid and "/" not in rid:
                return upstream_path, rid
    return None
