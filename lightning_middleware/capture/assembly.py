"""Turn what an OpenAI-compatible server sent back into one recorded call.

Works on bytes as they pass through the transport: a whole JSON body, or an SSE
stream fed chunk by chunk. vLLM's extra fields are the point: top-level
`prompt_token_ids` and per-choice `token_ids` (also per chunk when streaming),
and logprobs. Choice 0's token IDs and logprobs become the record's columns; those of
the other choices of a request with `n` > 1 become its `extra_choices` (each with its own
token IDs, logprobs and finish reason). The response JSON is kept minus the token arrays,
which are stored compactly beside it.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware import fastjson
from lightning_middleware.capture.shape import body_problem, choice_problem, chunk_problem
from lightning_middleware.records import Choice


@dataclass
class Assembled:
    response: dict[str, Any] | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    complete: bool = False
    error: str | None = None
    extra_choices: list[Choice] = field(default_factory=list)  # choices 1.. of the same prompt, by index
    # Choice 0's text exactly as sampled (a chat answer's logprob tokens joined), before the server's
    # tool-call parser took it apart; None without logprobs, or when not asked for (only
    # `capture.exact_history` needs it: every other call skips the work).
    sampled_text: str | None = None
    # The token ID that ended choice 0 as its EOS, where the answer shows it (read with sampled_text):
    # what `EosHints.eos_ids` learns for the model's later answers.
    eos_id: int | None = None


@dataclass(frozen=True)
class EosHints:
    """What tells whether a chat answer's last token is the EOS that ended it (exact_history).
    vLLM reports "tool_calls" whenever its parser found a call, also in an answer cut at the
    request's token limit, whose last token is text. Below the limit such an answer ended by its
    EOS; at the limit its last token is the EOS only if it is one of the IDs seen ending this
    model's earlier answers (a "stop" with no stop string or token names its EOS)."""

    token_limit: int | None = None  # the request's most completion tokens
    eos_ids: frozenset[int] = frozenset()


NO_HINTS = EosHints()


def _token_bytes(choice: dict[str, Any]) -> list[bytes] | None:
    """The bytes of each sampled token of a chat choice (its logprob entries), or None."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        return None
    out = []
    for entry in content:
        raw = entry.get("bytes") if isinstance(entry, dict) else None
        if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
            out.append(bytes(raw))
        elif isinstance(entry, dict) and isinstance(entry.get("token"), str):
            out.append(entry["token"].encode("utf-8"))
        else:
            return None
    return out


def _joined(pieces: list[bytes], n_ids: int, ended_by_eos: bool) -> str | None:
    """The sampled text from one piece per token; vLLM counts the EOS token that ended an answer
    (`stop_reason` null) among them, and it is no part of the text the template renders back."""
    if len(pieces) != n_ids or not pieces:
        return None
    if ended_by_eos:
        pieces = pieces[:-1]
    try:
        return b"".join(pieces).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _ended_by_eos(choice: dict[str, Any], ids: list[int], hints: EosHints) -> bool:
    """Is the choice's last token the EOS that ended it? (EosHints says how "tool_calls" is read.)
    An EOS at exactly the limit before any answer of the model showed its EOS counts as a cut."""
    if "stop_reason" not in choice or choice["stop_reason"] is not None or not ids:
        return False  # a stop string or token ended it (or not vLLM): no EOS among the tokens
    finish = choice.get("finish_reason")
    if finish == "stop":
        return True
    limit = hints.token_limit
    return finish == "tool_calls" and (limit is None or len(ids) < limit or ids[-1] in hints.eos_ids)


def token_limit(request: dict[str, Any]) -> int | None:
    """The most completion tokens a chat request allows, if it says."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


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


def _safe_logprobs(choice: dict[str, Any], endpoint: str) -> list[float] | None:
    try:
        return _logprobs_of(choice, endpoint)
    except (KeyError, TypeError, ValueError, AttributeError):  # a block of any shape: no logprobs
        return None


def _aligned(logprobs: list[float] | None, ids: Any) -> list[float] | None:
    """Logprobs only if there is one per token ID (when there are token IDs): misaligned ones
    would pair tokens with other tokens' logprobs in training."""
    if logprobs is None or not isinstance(ids, list) or not ids or len(logprobs) == len(ids):
        return logprobs
    return None


def _choice_record(choice: dict[str, Any], position: int, endpoint: str) -> Choice | None:
    """A whole-body choice as a record; None if its token IDs are not integers (a broken server)."""
    index = choice.get("index")
    try:
        ids = tuple(int(t) for t in choice.get("token_ids") or ())
    except (TypeError, ValueError):
        return None
    lp = _aligned(_safe_logprobs(choice, endpoint), list(ids))
    return Choice(index if isinstance(index, int) else position, ids, tuple(lp) if lp is not None else None,
                  choice.get("finish_reason"))


def _extra_choices(choices: list[Any], prompt_ids: list[int], endpoint: str) -> list[Choice]:
    """Choices 1.. that answer the same prompt, in index order; none if the server sent no token IDs.

    A batched completions request (a list of prompts) answers one choice per prompt: a choice
    whose own `prompt_token_ids` differ from the call's is not an alternative and is not kept.
    """
    if not prompt_ids:
        return []
    out: dict[int, Choice] = {}
    for position, choice in enumerate(choices[1:], 1):
        if choice_problem(choice, endpoint, streamed=False):  # a broken choice costs only itself
            continue
        own = choice.get("prompt_token_ids")
        if own and list(own) != prompt_ids:
            continue
        record = _choice_record(choice, position, endpoint)
        if record is not None and record.index > 0:  # an index repeated (a broken server): the first
            out.setdefault(record.index, record)
    return [out[i] for i in sorted(out)]


def parse_body(raw: bytes, endpoint: str, *, sampled_text: bool = False, eos: EosHints = NO_HINTS) -> Assembled:
    try:
        body = fastjson.loads(raw)
    except ValueError as exc:
        return Assembled(error=f"response is not JSON: {exc}")
    if not isinstance(body, dict):
        return Assembled(error="response JSON is not an object")
    problem = body_problem(body, endpoint)
    if problem:  # kept as it came, its tokens unread: a call to look at, never one to train on
        return Assembled(response=_strip_token_fields(body), complete=True, error=f"malformed response: {problem}")
    out = Assembled(response=_strip_token_fields(body), complete=True)
    choices = body.get("choices") or []
    choices = choices if isinstance(choices, list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt_ids = body.get("prompt_token_ids") or first.get("prompt_token_ids")
    out.prompt_token_ids = list(prompt_ids or [])
    out.completion_token_ids = list(first.get("token_ids") or [])
    out.finish_reason = first.get("finish_reason")
    out.logprobs = _aligned(_safe_logprobs(first, endpoint), out.completion_token_ids)
    out.extra_choices = _extra_choices(choices, out.prompt_token_ids, endpoint)
    if sampled_text and endpoint == "chat.completions" and out.completion_token_ids:
        ended = _ended_by_eos(first, out.completion_token_ids, eos)
        out.eos_id = out.completion_token_ids[-1] if ended else None
        pieces = _token_bytes(first)
        if pieces is not None:
            out.sampled_text = _joined(pieces, len(out.completion_token_ids), ended)
    return out


# --------------------------------------------------------------------------
# Server-sent event streams
# --------------------------------------------------------------------------

class _StreamChoice:
    """One choice of a stream, rebuilt from the deltas that carry its `index`."""

    def __init__(self, index: int, endpoint: str, sampled_text: bool = False, eos: EosHints = NO_HINTS) -> None:
        self.index, self.endpoint = index, endpoint
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.role = "assistant"
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.prompt_ids: list[int] = []  # completions sends them per choice
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.has_logprobs = False
        self.unreadable_logprobs = False
        self.finish: str | None = None
        # the sampled text's bytes, per token (None: not asked for, or unreadable)
        self.pieces: list[bytes] | None = [] if sampled_text and endpoint == "chat.completions" else None
        self.ended_by_eos = False
        self.eos = eos

    def feed(self, choice: dict[str, Any]) -> None:
        if choice.get("prompt_token_ids"):
            self.prompt_ids = list(choice["prompt_token_ids"])
        self.token_ids.extend(choice.get("token_ids") or [])
        try:
            lp = _logprobs_of(choice, self.endpoint)
        except (KeyError, TypeError, ValueError, AttributeError):
            # A malformed block costs the choice its logprobs, not its record: the ones that came
            # can no longer be paired with their tokens (as in a whole body, `_safe_logprobs`).
            self.unreadable_logprobs = True
            lp = None
        if lp is not None:
            self.has_logprobs = True
            self.logprobs.extend(lp)
        if self.pieces is not None and choice.get("logprobs") is not None:
            pieces = _token_bytes(choice)
            if pieces is None:
                self.pieces = None
            else:
                self.pieces.extend(pieces)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.ended_by_eos = _ended_by_eos(choice, self.token_ids, self.eos)
        if self.endpoint == "completions":
            self.text.append(choice.get("text") or "")
            return
        delta = choice.get("delta") or {}
        self.role = delta.get("role") or self.role
        if delta.get("content"):
            self.text.append(delta["content"])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            self.reasoning.append(reasoning)
        for tc in delta.get("tool_calls") or []:
            self._tool_call_delta(tc)

    def _tool_call_delta(self, tc: dict[str, Any]) -> None:
        slot = self.tool_calls.setdefault(int(tc.get("index", 0)),
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

    def as_json(self) -> dict[str, Any]:
        """The choice as a whole (non-streamed) response would have it."""
        text = "".join(self.text)
        if self.endpoint == "completions":
            return {"index": self.index, "text": text, "finish_reason": self.finish}
        message: dict[str, Any] = {"role": self.role, "content": text or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return {"index": self.index, "message": message, "finish_reason": self.finish}

    def record(self) -> Choice | None:
        """The choice as a record; None if its token IDs are not integers (a broken server)."""
        try:
            ids = tuple(int(t) for t in self.token_ids)
        except (TypeError, ValueError):
            return None
        lp = self.kept_logprobs()
        return Choice(self.index, ids, tuple(lp) if lp is not None else None, self.finish)

    def kept_logprobs(self) -> list[float] | None:
        """The logprobs, if every block was readable and there is one per token."""
        if not self.has_logprobs or self.unreadable_logprobs:
            return None
        return _aligned(self.logprobs, self.token_ids)


class StreamAssembler:
    """Rebuilds a streamed chat/completions response from its SSE chunks, incrementally.

    With `n` > 1 the chunks of the choices interleave; each is assembled by its `index`.
    """

    def __init__(self, endpoint: str, *, sampled_text: bool = False, eos: EosHints = NO_HINTS) -> None:
        self.endpoint = endpoint
        self.sampled_text, self.eos = sampled_text, eos
        self._pending = b""
        self._done = False
        self._head: dict[str, Any] = {}
        self._saw_choice = False  # a chunk with a choice came (a stream of only usage or [DONE] is no answer)
        self._broken: set[int] = set()  # choices a malformed delta came for
        # Choice 0 always exists, so a stream that never sent a choice still records one (as before n > 1).
        self._choices: dict[int, _StreamChoice] = {0: _StreamChoice(0, endpoint, sampled_text, eos)}
        self._prompt_ids: list[int] = []
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
        if not isinstance(chunk, dict):
            self._errors.append("a stream chunk is not a JSON object")
            return
        problem = None if "error" in chunk and "choices" not in chunk else chunk_problem(chunk)
        if problem:  # its tokens unread: the stream is recorded, never trained on
            self._errors.append(f"malformed stream chunk: {problem}")
            return
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
            self._saw_choice = True
            index = choice.get("index", 0) if isinstance(choice, dict) else 0
            index = index if isinstance(index, int) and not isinstance(index, bool) else 0
            problem = choice_problem(choice, self.endpoint, streamed=True)
            if problem:  # choice 0 is the record: the stream is broken; another costs only itself
                self._broken.add(index)
                if index == 0:
                    self._errors.append(f"malformed stream chunk: {problem}")
                continue
            slot = self._choices.get(index)
            if slot is None:
                slot = self._choices[index] = _StreamChoice(index, self.endpoint, self.sampled_text, self.eos)
            slot.feed(choice)

    def _extra_choices(self, prompt_ids: list[int]) -> list[Choice]:
        """Choices 1.. that answer the same prompt (a batched completions request answers one
        choice per prompt: those are not alternatives); none if the server sent no token IDs."""
        if not prompt_ids:
            return []
        records = (self._choices[i].record() for i in sorted(self._choices)
                   if i > 0 and i not in self._broken and self._choices[i].prompt_ids in ([], prompt_ids))
        return [r for r in records if r is not None]

    def result(self) -> Assembled:
        if self._pending.strip():
            self._line(self._pending.rstrip(b"\r"))
            self._pending = b""
        first = self._choices[0]
        # Complete: [DONE], or every choice finished (a stream cut after choice 0 ended is partial).
        complete = self._done or all(c.finish is not None for c in self._choices.values())
        obj = "text_completion" if self.endpoint == "completions" else "chat.completion"
        response = {**self._head, "object": obj, "choices": [self._choices[i].as_json() for i in sorted(self._choices)]}
        if self._usage is not None:
            response["usage"] = self._usage
        prompt_ids = self._prompt_ids or first.prompt_ids
        if not self._saw_choice and not self._errors:
            self._errors.append("the stream carried no completion chunk")
        return Assembled(
            response=response,
            prompt_token_ids=prompt_ids,
            completion_token_ids=first.token_ids,
            logprobs=first.kept_logprobs(),
            finish_reason=first.finish,
            complete=complete and not self._errors,
            error="; ".join(self._errors) or None,
            extra_choices=self._extra_choices(prompt_ids),
            sampled_text=None if first.pieces is None or not first.has_logprobs
            else _joined(first.pieces, len(first.token_ids), first.ended_by_eos),
            eos_id=first.token_ids[-1] if self.sampled_text and first.ended_by_eos else None,
        )


class BodyCollector:
    """Feeds raw response bytes to the right parser, decoding content-encoding."""

    def __init__(self, endpoint: str, streaming: bool, content_encoding: str | None, *,
                 sampled_text: bool = False, eos: EosHints = NO_HINTS) -> None:
        """`sampled_text`: join the answer's sampled text (exact_history); `eos`: what tells a
        cut answer from one its EOS ended."""
        self.endpoint, self.sampled_text, self.eos = endpoint, sampled_text, eos
        self._decode = _Decoder(content_encoding)
        self._stream = StreamAssembler(endpoint, sampled_text=sampled_text, eos=eos) \
            if streaming else None
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
        return parse_body(b"".join(self._parts), self.endpoint, sampled_text=self.sampled_text, eos=self.eos)

    def raw_text(self, limit: int = 2000) -> str:
        return b"".join(self._parts)[:limit].decode("utf-8", "replace")
