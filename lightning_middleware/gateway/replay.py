"""One upstream call per logical call: a retried request is answered from the first one.

An `Idempotency-Key` header replays the stored response for `idempotency_ttl_s`. Without a key,
only a request that says it is a retry (the openai SDK's `x-stainless-retry-count` above 0, which
LangChain, AutoGen and the Agents SDK send through it too) is matched by its body: resent within a
rollout while the first copy is in flight, or within `retry_window_s` after it succeeded, it is
answered from the first (a client's retry storm stays one call). An identical body that is not a
retry is a new sample (self-consistency, a task retried at temperature > 0) and goes upstream. A
failed call is never replayed: its retry goes upstream.

The key is also kept with the call's record (`LLMCall.idempotency_key`): a retry that reaches a
restarted gateway, or another replica on the same store, is answered from the record
(`answer_from_record`) and records nothing, so it is never trained twice. Such an answer carries
what the record holds: the message or text, tool calls, finish reason, usage and the token IDs,
but not the logprob blocks (the record keeps their values alone). A retry sent before the first
call's record was written (the store's writer batches every ~50 ms) can still reach the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware import fastjson
from lightning_middleware.asgi.error_replies import HTTPError
from lightning_middleware.asgi.replies import JSON_HEADERS, Headers
from lightning_middleware.records import LLMCall

Key = tuple[str, ...]


@dataclass(frozen=True)
class Cached:
    """A successful answer as it was sent to the caller (ASGI form)."""

    status: int
    headers: Headers
    body: bytes


@dataclass
class Flight:
    """A call running upstream (or done), that identical requests wait on."""

    body_hash: str
    ttl: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Cached | None = None
    finished_at: float = 0.0

    def expired(self, now: float) -> bool:
        return self.result is None or now - self.finished_at > self.ttl


RETRY_HEADER = "x-stainless-retry-count"  # the openai SDK's attempt counter (0 on the first attempt)


def is_retry(headers: Mapping[str, str]) -> bool:
    """The request says it repeats an earlier attempt."""
    try:
        return int(headers.get(RETRY_HEADER, "0")) > 0
    except ValueError:
        return False


class ReplayCache:
    """Flights by key, oldest first; bounded by `max_entries` (in-flight entries are never dropped)."""

    def __init__(self, *, retry_window_s: float = 30.0, idempotency_ttl_s: float = 3600.0,
                 max_entries: int = 1024, max_wait_s: float = 660.0) -> None:
        self.retry_window_s, self.idempotency_ttl_s = retry_window_s, idempotency_ttl_s
        self.max_entries, self.max_wait_s = max_entries, max_wait_s
        self.replayed = 0
        self._flights: OrderedDict[Key, Flight] = OrderedDict()

    def __len__(self) -> int:
        return len(self._flights)

    def key_for(self, headers: Mapping[str, str], rollout_id: str | None, path: str,
                body_hash: str) -> tuple[Key | None, float]:
        """The key a call is deduplicated under and how long its answer is kept (None: not at all)."""
        idem = headers.get("idempotency-key")
        if idem:
            return ("idem", rollout_id or "", idem), self.idempotency_ttl_s
        if rollout_id and self.retry_window_s > 0:
            return ("body", rollout_id, path, body_hash), self.retry_window_s
        return None, 0.0

    async def claim(self, key: Key, ttl: float, body_hash: str, *, replay: bool = True) -> Flight | Cached:
        """A new flight the caller must run and `land`, or the cached answer to replay. With
        `replay=False` (an identical body that is not a retry: a new sample) always a new flight,
        which later retries of this body are answered from."""
        while True:
            found = self._flights.get(key) if replay else None
            if found is not None and found.body_hash != body_hash:  # (only idempotency keys can differ)
                raise HTTPError(409, "Idempotency-Key reused with a different request body",
                                code="idempotency_conflict")
            if found is None or (found.done.is_set() and found.expired(time.monotonic())):
                flight = self._flights[key] = Flight(body_hash, ttl)
                self._flights.move_to_end(key)
                self._evict()
                return flight
            if not found.done.is_set():
                try:  # the first copy is still running: wait for its answer
                    await asyncio.wait_for(found.done.wait(), self.max_wait_s)
                except asyncio.TimeoutError:
                    raise HTTPError(504, "an identical earlier request is still running upstream",
                                    type="upstream_timeout", code="upstream_timeout") from None
                continue
            self.replayed += 1
            assert found.result is not None
            return found.result

    def land(self, key: Key, flight: Flight, result: Cached | None) -> None:
        """The flight finished: keep `result` for replays, or forget the key (a failure)."""
        if flight.done.is_set():
            return
        flight.result = result
        flight.finished_at = time.monotonic()
        flight.done.set()
        if result is None and self._flights.get(key) is flight:
            del self._flights[key]

    def _evict(self) -> None:
        """Drop expired or surplus entries from the oldest end; a few per call (amortised)."""
        now = time.monotonic()
        for _ in range(8):
            if not self._flights:
                return
            key, fl = next(iter(self._flights.items()))
            over = len(self._flights) > self.max_entries
            if not fl.done.is_set():
                if not over:
                    return
                self._flights.move_to_end(key)  # in flight: never dropped
                continue
            if over or now - fl.finished_at > fl.ttl:
                self._flights.popitem(last=False)
                continue
            return


SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def answer_from_record(call: LLMCall, *, stream: bool) -> tuple[Headers, bytes]:
    """The engine's answer to a recorded call, rebuilt (headers, body): a whole body, or with
    `stream` the same content as one event per choice, the usage, and `[DONE]`."""
    response = dict(call.response or {})
    ids = {c.index: c.completion_token_ids for c in call.choices}
    choices = [dict(ch, token_ids=list(ids.get(ch.get("index", 0), ()))) if isinstance(ch, dict) else ch
               for ch in response.get("choices") or []]
    if not stream:
        whole = {**response, "choices": choices}
        if call.prompt_token_ids:
            whole["prompt_token_ids"] = list(call.prompt_token_ids)
        return JSON_HEADERS, fastjson.dumps(whole).encode()
    head: dict[str, Any] = {k: response[k] for k in ("id", "model", "created", "system_fingerprint") if k in response}
    chat = call.endpoint != "completions"
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events: list[dict[str, Any]] = []
    for n, ch in enumerate(choices):
        if not isinstance(ch, dict):
            continue
        event: dict[str, Any] = {**head, "choices": [_stream_choice(ch, chat)]}
        if n == 0 and call.prompt_token_ids:
            event["prompt_token_ids"] = list(call.prompt_token_ids)
        events.append(event)
    if response.get("usage"):
        events.append({**head, "choices": [], "usage": response["usage"]})
    return SSE_HEADERS, b"".join(b"data: " + fastjson.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _stream_choice(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    """One choice of a whole answer as a single stream delta."""
    out = {"index": choice.get("index", 0), "finish_reason": choice.get("finish_reason"),
           "token_ids": choice.get("token_ids", [])}
    if not chat:
        return {**out, "text": choice.get("text") or ""}
    message = choice.get("message") or {}
    delta = {k: v for k, v in message.items() if k != "tool_calls" and v is not None}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(message["tool_calls"])]
    return {**out, "delta": delta}
