"""Reading requests off raw ASGI messages: the body within a size limit, JSON objects, and
which proxy route (and per-rollout base URL) a path is."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from lightning_middleware import fastjson
from lightning_middleware.gateway.errors import HTTPError
from lightning_middleware.gateway.responses import Receive

MAX_DEPTH = 1024  # JSON nesting orjson accepts; deeper bodies get a 400
ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")  # rollout ids: safe in a URL path and a log line


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
    """A JSON object from a request body (orjson; the standard library only for what orjson
    rejects, e.g. integers beyond 64 bits), or a 400."""
    try:
        payload = fastjson.loads(raw)
    except ValueError as exc:
        if "depth limit" in str(exc):  # orjson stops at 1024 levels; the stdlib would overflow the stack
            raise HTTPError(400, f"request body is nested more than {MAX_DEPTH} levels deep",
                            code="invalid_json") from None
        try:
            payload = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc2:
            raise HTTPError(400, f"request body is not valid JSON: {exc2}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    return payload


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
