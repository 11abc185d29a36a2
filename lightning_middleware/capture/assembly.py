"""Turn what an OpenAI-compatible server sent back into one recorded call.

Works on bytes as they pass through the transport: a whole JSON body, or an SSE
stream fed chunk by chunk. vLLM's extra fields are the point: top-level
`prompt_token_ids` and per-choice `token_ids` (also per chunk when streaming),
and logprobs. Only choice 0 is kept as token arrays; the full response JSON is
kept minus the token arrays, which are stored compactly beside it.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware import fastjson


@dataclass
class Assembled:
    response: dict[str, Any] | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    complete: bool = False
    error: str | None = None


# --------------------------------------------------------------------------
# Content-encoding: we ask for identity, but decode gzip/deflate if sent anyway.
# --------------------------------------------------------------------------

class _Decoder:
    def __init__(self, encoding: str | None) -> None:
        enc = (encoding or "identity").lower().strip()
        self.unsupported = enc not in ("identity", "", "gzip", "deflate")
        self._z = None
        if enc == "gzip":
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self._z = zlib.decompressobj()

    def __call__(self, data: bytes) -> bytes:
        return data if self._z is None else self._z.decompress(data)


# --------------------------------------------------------------------------
# Whole-body responses
# --------------------------------------------------------------------------

def _logprobs_of(choice: dict[str, Any], endpoint: str) -> list[float] | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if endpoint == "completions":
        values = lp.get("token_logprobs")
        return [float(v) for v in values] if values is not None else None
    content = lp.get("content")
    return None if content is None else [float(c["logprob"]) for c in content]


def _strip_token_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The response as stored: token arrays and logprobs live in their own columns."""
    out = {k: v for k, v in body.items() if k != "prompt_token_ids"}
    if isinstance(out.get("choices"), list):
        out["choices"] = [
            {k: v for k, v in ch.items() if k not in ("token_ids", "logprobs", "prompt_token_ids")}
            if isinstance(ch, dict) else ch
            for ch in out["choices"]
        ]
    return out


def parse_body(raw: bytes, endpoint: str) -> Assembled:
    try:
        body = fastjson.loads(raw)
    except ValueError as exc:
        return Assembled(error=f"response is not JSON: {exc}")
    if not isinstance(body, dict):
        return Assembled(error="response JSON is not an object")
    out = Assembled(response=_strip_token_fields(body), complete=True)
    choices = body.get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt_ids = body.get("prompt_token_ids") or first.get("prompt_token_ids")
    out.prompt_token_ids = list(prompt_ids or [])
    out.completion_token_ids = list(first.get("token_ids") or [])
    out.finish_reason = first.get("finish_reason")
    try:
        out.logprobs = _logprobs_of(first, endpoint)
    except (KeyError, TypeError, ValueError):
        out.logprobs = None
    return out


# --------------------------------------------------------------------------
# Server-sent event streams
# --------------------------------------------------------------------------

class StreamAssembler:
    """Rebuilds a streamed chat/completions response from its SSE chunks, incrementally."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._pending = b""
        self._done = False
        self._head: dict[str, Any] = {}
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._role = "assistant"
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._prompt_ids: list[int] = []
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._has_logprobs = False
        self._finish: str | None = None
        self._usage: Any = None
        self._errors: list[str] = []

    def feed(self, data: bytes) -> None:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            self._line(line.rstrip(b"\r"))

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return  # comments, event names, blank separators
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self._done = True
            return
        try:
            chunk = fastjson.loads(payload)
        except ValueError:
            self._errors.append("unparseable stream chunk")
            return
        if isinstance(chunk, dict):
            self._chunk(chunk)

    def _chunk(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk and "choices" not in chunk:
            self._errors.append(json.dumps(chunk["error"])[:500])
            return
        if not self._head:
            self._head = {k: chunk.get(k) for k in ("id", "model", "created", "system_fingerprint")}
        if chunk.get("prompt_token_ids"):
            self._prompt_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) == 0:
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if choice.get("prompt_token_ids"):  # completions puts them per choice
            self._prompt_ids = list(choice["prompt_token_ids"])
        self._token_ids.extend(choice.get("token_ids") or [])
        lp = _logprobs_of(choice, self.endpoint)
        if lp is not None:
            self._has_logprobs = True
            self._logprobs.extend(lp)
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        if self.endpoint == "completions":
            self._text.append(choice.get("text") or "")
            return
        delta = choice.get("delta") or {}
        self._role = delta.get("role") or self._role
        if delta.get("content"):
            self._text.append(delta["content"])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            self._reasoning.append(reasoning)
        for tc in delta.get("tool_calls") or []:
            self._tool_call_delta(tc)

    def _tool_call_delta(self, tc: dict[str, Any]) -> None:
        slot = self._tool_calls.setdefault(int(tc.get("index", 0)),
                                           {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if tc.get("id"):
            slot["id"] = tc["id"]
        if tc.get("type"):
            slot["type"] = tc["type"]
        fn = tc.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]

    def result(self) -> Assembled:
        if self._pending.strip():
            self._line(self._pending.rstrip(b"\r"))
            self._pending = b""
        complete = self._finish is not None or self._done
        text = "".join(self._text)
        if self.endpoint == "completions":
            choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": self._finish}
            obj = "text_completion"
        else:
            message: dict[str, Any] = {"role": self._role, "content": text or None}
            if self._reasoning:
                message["reasoning_content"] = "".join(self._reasoning)
            if self._tool_calls:
                message["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
            choice = {"index": 0, "message": message, "finish_reason": self._finish}
            obj = "chat.completion"
        response = {**self._head, "object": obj, "choices": [choice]}
        if self._usage is not None:
            response["usage"] = self._usage
        return Assembled(
            response=response,
            prompt_token_ids=self._prompt_ids,
            completion_token_ids=self._token_ids,
            logprobs=self._logprobs if self._has_logprobs else None,
            finish_reason=self._finish,
            complete=complete and not self._errors,
            error="; ".join(self._errors) or None,
        )


class BodyCollector:
    """Feeds raw response bytes to the right parser, decoding content-encoding."""

    def __init__(self, endpoint: str, streaming: bool, content_encoding: str | None) -> None:
        self.endpoint = endpoint
        self._decode = _Decoder(content_encoding)
        self._stream = StreamAssembler(endpoint) if streaming else None
        self._parts: list[bytes] = []

    def feed(self, data: bytes) -> None:
        if self._decode.unsupported:
            return
        decoded = self._decode(data)
        if self._stream is not None:
            self._stream.feed(decoded)
        else:
            self._parts.append(decoded)

    def result(self) -> Assembled:
        if self._decode.unsupported:
            return Assembled(error="response content-encoding not decodable by the recorder")
        if self._stream is not None:
            return self._stream.result()
        return parse_body(b"".join(self._parts), self.endpoint)

    def raw_text(self, limit: int = 2000) -> str:
        return b"".join(self._parts)[:limit].decode("utf-8", "replace")


# --------------------------------------------------------------------------
# Giving the caller the response it asked for
# --------------------------------------------------------------------------

def strip_added(obj: dict[str, Any], added: frozenset[str]) -> None:
    """Remove from a response (or stream chunk) the fields only our injected request fields produced."""
    if "return_token_ids" in added:
        obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or ():
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
        return fastjson.dumps(body).encode()


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
                strip_added(chunk, self._added)
                return b"data: " + fastjson.dumps(chunk).encode() + b"\n\n"
            except ValueError:
                pass
        return event + b"\n\n"

    def finish(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest
