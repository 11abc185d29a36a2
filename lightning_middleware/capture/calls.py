"""One recorded call: what capture adds to a request (token IDs, logprobs), the attempt while
it runs, and the record built from its bytes on the store's writer thread.

`begin_call` is the entry both the `wrap()` transport and the gateway use, so an agent in the
process and one behind the gateway are recorded by the same code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware import fastjson
from lightning_middleware.capture.assembly import NO_HINTS, Assembled, BodyCollector, EosHints, token_limit
from lightning_middleware.capture.context import (
    AGENT_HEADER,
    ROLLOUT_HEADER,
    RolloutState,
    current_agent,
    current_rollout,
    state_for_header,
)
from lightning_middleware.records import LLMCall, new_id
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)

_ENDPOINTS = (("/chat/completions", "chat.completions"), ("/completions", "completions"), ("/responses", "responses"),
              ("/v1/messages", "anthropic.messages"))
TRAINABLE_ENDPOINTS = frozenset({"chat.completions", "completions"})  # vLLM returns token IDs for these
ROUTING_HEADERS = (ROLLOUT_HEADER, AGENT_HEADER)
INT32_MAX = 2**31 - 1  # the store's integer columns (attempt, policy_version) are 32-bit
_warned: set[str] = set()


def reset_warnings() -> None:
    """Forget which once-per-process warnings were logged (tests that check a warning)."""
    _warned.clear()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


# Request-body keys that carry credentials: never stored (the gateway also never forwards them).
_SECRET_KEYS = frozenset({
    "api_key", "apikey", "api-key", "openai_api_key", "authorization", "access_token", "token", "secret",
    "client_secret", "password", "bearer_token", "auth",
})
_HEADER_LIKE_KEYS = ("headers", "extra_headers", "default_headers")


def scrub_secrets(payload: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The request body without credential fields (top level, and header-like dicts). (body, changed)."""
    changed = False
    out: dict[str, Any] = {}
    for k, v in payload.items():
        lk = k.lower() if isinstance(k, str) else k
        if lk in _SECRET_KEYS:
            changed = True
            continue
        if lk in _HEADER_LIKE_KEYS and isinstance(v, dict):
            kept = {hk: hv for hk, hv in v.items()
                    if not (isinstance(hk, str) and (hk.lower() in _SECRET_KEYS or hk.lower() in ("x-api-key",)))}
            if len(kept) != len(v):
                changed = True
                v = kept
        out[k] = v
    return out, changed


def _endpoint_of(path: str) -> str | None:
    for suffix, name in _ENDPOINTS:
        if path.rstrip("/").endswith(suffix):
            return name
    return None


@dataclass
class CaptureSettings:
    """How a wrapped client records. Shared by every transport `wrap()` installed for it."""

    store: TraceStore
    record_unattached: bool = True
    inject_token_ids: bool = True
    inject_logprobs: bool = True
    # Remove the fields only our injection produced from what the caller gets (the gateway keeps them).
    strip_added: bool = True
    # Responses / Anthropic Messages requests sent as chat completions: None (the default) translates
    # unless the host is the format's own vendor API (`formats.Format.vendor_hosts`), True always, False never.
    translate: bool | None = None
    # Hosts that answered 400 to the injected fields: leave their requests alone.
    no_inject_hosts: set[str] = field(default_factory=set)
    # Model name -> the token IDs seen ending its answers as their EOS (exact_history reads an
    # answer of exactly max_tokens by them: assembly.EosHints). Replaced, never changed in place.
    eos_ids: dict[str, frozenset[int]] = field(default_factory=dict)
    # Separate policies per agent: agent name -> the served model name of its policy (a LoRA
    # adapter's name). A call of a mapped agent is sent, and recorded, under that model whatever
    # model the agent code wrote; other agents' calls go to `default_policy` (None: as written).
    policies: Mapping[str, str] = field(default_factory=dict)
    default_policy: str | None = None
    # Send a rollout's earlier tool-calling turns back as the text the model sampled (capture/exact_history.py).
    exact_history: bool = False
    _unattached_counter: Any = field(default_factory=lambda: _Counter())

    def policy_for(self, agent: str | None, state: RolloutState | None = None) -> str | None:
        """The served model name a call of `agent` goes to, or None to leave the request's own:
        the rollout's own map first, then this map, then the rollout's default, then this one."""
        if agent is not None:
            if state is not None and agent in state.policies:
                return state.policies[agent]
            if agent in self.policies:
                return self.policies[agent]
        if state is not None and state.default_policy is not None:
            return state.default_policy
        return self.default_policy


class _Counter:
    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._n += 1
            return self._n - 1


@dataclass(frozen=True)
class Source:
    """What the caller sent when it spoke another format: the call went to the engine translated
    into chat completions (`lightning_middleware.formats`), and its record keeps both."""

    format: str  # "responses" | "anthropic.messages"
    request: dict[str, Any]


# --------------------------------------------------------------------------
# One call in flight. The agent's thread only collects bytes; parsing them into
# a record happens on the store's writer thread (`DeferredCall.build`).
# --------------------------------------------------------------------------

@dataclass
class PendingCall:
    settings: CaptureSettings
    endpoint: str
    state: RolloutState | None
    call_index: int
    attempt: int
    agent_name: str | None
    body: bytes  # the request body as the caller sent it
    payload: dict[str, Any]  # ... parsed
    added: frozenset[str]  # fields we added to the request (removed again from what the caller gets)
    source: Source | None = None  # the caller's own request, when `payload` is its translation
    idempotency_key: str | None = None  # kept with the record: a later retry is answered from it
    # The record's id, known before the answer: a translated answer carries it (`resp_<id>`).
    call_id: str = field(default_factory=new_id)
    started_at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    done: bool = False

    @property
    def remembers_turns(self) -> bool:
        """exact_history keeps this call's sampled text for its rollout's later requests."""
        return self.settings.exact_history and self.state is not None and self.endpoint == "chat.completions"

    @property
    def store(self) -> TraceStore:
        return self.state.store if self.state is not None else self.settings.store

    def rejected(self, status_code: int, host: str) -> bool:
        """Did `host` answer 400 to a request we added fields to? Then the caller's request is to
        be resent as written (`self.body`): recording is never why a call fails."""
        if not (self.added and status_code == 400):
            return False
        self.added = frozenset()
        return True

    def resent(self, status_code: int, host: str) -> None:
        """The answer to the request resent as written after `rejected`. If it succeeded, the host
        refuses our fields (not vLLM?): stop adding them there. If it failed too, the 400 was
        about the request itself (a context too long, a bad message), and the host keeps getting
        them: one such 400 must not end token IDs for the rest of the process."""
        if status_code >= 400:
            return
        self.settings.no_inject_hosts.add(host)
        _warn_once(f"reject:{host}", "%s rejected return_token_ids/logprobs (not vLLM?); sending requests "
                   "to it unchanged from now on, without token IDs", host)

    def finish(self, *, status_code: int | None = None, chunks: list[bytes] | None = None,
               headers: Any = None, error: str | None = None) -> None:
        """Hand the call to the store's writer exactly once. Never raises."""
        if self.done:
            return
        self.done = True
        try:
            deferred = DeferredCall(self, status_code, chunks or [], headers, error, time.perf_counter() - self.t0)
            state = self.state if self.remembers_turns else None
            if state is not None and status_code is not None and 200 <= status_code < 300:
                # Now, not on the writer thread: the rollout's next request may carry this turn back.
                a = deferred.assembled()
                state.sampled_turns.remember(a.response, a.sampled_text if a.complete and not a.error else None)
            self.store.submit_call(deferred)
        except Exception:  # recording must not break the agent
            log.exception("could not record an LLM call")


class DeferredCall:
    """A finished HTTP attempt, turned into an `LLMCall` by `build()` on the writer thread."""

    def __init__(self, pending: PendingCall, status_code: int | None, chunks: list[bytes], headers: Any,
                 error: str | None, latency_s: float) -> None:
        self.pending = pending
        self.status_code = status_code
        self.chunks = chunks
        self.content_type = headers.get("content-type", "") if headers is not None else ""
        self.content_encoding = headers.get("content-encoding") if headers is not None else None
        self.policy_version = _policy_version_of(headers)
        self.error = error
        self.latency_s = latency_s
        self._collector: BodyCollector | None = None
        self._assembled: Assembled | None = None

    def assembled(self) -> Assembled:
        """The answer's bytes parsed (once)."""
        if self._assembled is None:
            p = self.pending
            self._collector = BodyCollector(p.endpoint, "text/event-stream" in self.content_type,
                                            self.content_encoding, sampled_text=p.remembers_turns,
                                            eos=self._eos_hints() if p.remembers_turns else NO_HINTS)
            for chunk in self.chunks:
                self._collector.feed(chunk)
            self._assembled = self._collector.result() if self.status_code is not None else Assembled()
            eos_id = self._assembled.eos_id  # set only where the hints were read
            if eos_id is not None and not p.payload.get("ignore_eos"):
                model = str(p.payload.get("model") or "")
                known = p.settings.eos_ids.get(model, frozenset())
                if eos_id not in known:
                    p.settings.eos_ids[model] = known | {eos_id}
        return self._assembled

    def _eos_hints(self) -> EosHints:
        """exact_history's: the request's token limit and the EOS IDs its model's answers showed."""
        payload = self.pending.payload
        if payload.get("ignore_eos"):  # vLLM's ignore_eos: an EOS ID sampled last is text the answer goes on after
            return EosHints(token_limit(payload))
        return EosHints(token_limit(payload), self.pending.settings.eos_ids.get(str(payload.get("model") or ""),
                                                                                frozenset()))

    def build(self) -> LLMCall:
        """The record; never raises (this runs on the store's writer thread, where an exception
        would cost the record): an answer nothing could read is recorded as a failed attempt."""
        try:
            return self._build()
        except Exception as exc:  # noqa: BLE001 - whatever the server sent, the attempt is recorded
            log.warning("could not read an LLM answer (%s: %s); recording the attempt as failed",
                        type(exc).__name__, exc)
            return self._unreadable(f"recorder: unreadable response: {type(exc).__name__}: {exc}")

    def _unreadable(self, error: str) -> LLMCall:
        p = self.pending
        if self.status_code is not None and not 200 <= self.status_code < 300:
            error = f"HTTP {self.status_code}; {error}"
        return LLMCall(id=new_id(), rollout_id=None if p.state is None else p.state.id, call_index=p.call_index,
                       attempt=p.attempt, endpoint=p.endpoint, agent_name=p.agent_name,
                       request=scrub_secrets(p.payload)[0], status_code=self.status_code,
                       stream="text/event-stream" in self.content_type, error=error, latency_s=self.latency_s,
                       started_at=p.started_at, policy_version=self.policy_version,
                       request_hash=hashlib.sha256(p.body).hexdigest(), idempotency_key=p.idempotency_key)

    def _build(self) -> LLMCall:
        p = self.pending
        streaming = "text/event-stream" in self.content_type
        a = self.assembled()
        ok = self.status_code is not None and 200 <= self.status_code < 300
        error = self.error
        if self.status_code is not None and not ok:
            raw = self._collector.raw_text(500) if self._collector is not None else ""
            error = f"HTTP {self.status_code}" + ("" if streaming else f": {raw}")
        has_ids = bool(a.prompt_token_ids) and bool(a.completion_token_ids)
        trainable = p.endpoint in TRAINABLE_ENDPOINTS
        if ok and a.complete and not has_ids and trainable:
            _warn_once("no-ids", "the LLM server returned no token IDs (is it vLLM?); calls are recorded "
                       "but can't be trained on")
        pv = self.policy_version
        if pv is None and p.state is not None:
            pv = p.state.policy_version
        return LLMCall(
            id=p.call_id,
            rollout_id=None if p.state is None else p.state.id,
            call_index=p.call_index,
            attempt=p.attempt,
            endpoint=p.endpoint,
            model=p.payload.get("model") or (a.response or {}).get("model"),
            agent_name=p.agent_name,
            request=scrub_secrets(p.payload)[0],
            response=a.response,
            prompt_token_ids=tuple(a.prompt_token_ids),
            completion_token_ids=tuple(a.completion_token_ids),
            logprobs=tuple(a.logprobs) if a.logprobs is not None else None,
            finish_reason=a.finish_reason,
            status_code=self.status_code,
            stream=streaming,
            partial=ok and not a.complete,
            is_training=ok and a.complete and has_ids and trainable and a.error is None,
            error=error or a.error,
            latency_s=self.latency_s,
            started_at=p.started_at,
            policy_version=pv,
            request_hash=hashlib.sha256(p.body).hexdigest(),
            extra_choices=tuple(a.extra_choices),
            source_format=None if p.source is None else p.source.format,
            source_request=None if p.source is None else scrub_secrets(p.source.request)[0],
            idempotency_key=p.idempotency_key,
        )


def begin_request(settings: CaptureSettings, request: Any, body: bytes, *, payload: dict[str, Any] | None = None,
                  source: Source | None = None) -> tuple[PendingCall | None, bytes | None]:
    """Decide whether to record `request`; returns (pending, new body or None if unchanged).

    `payload`: the body already parsed (a translated request); `source`: what the caller sent.
    """
    endpoint = _endpoint_of(request.url.path)
    if endpoint is None or request.method != "POST":
        return None, None
    if payload is None:
        try:
            payload = fastjson.loads(body) if body else None
        except ValueError:
            payload = None
    if not isinstance(payload, dict):
        return None, None
    return begin_call(settings, endpoint, payload, body, request_state(settings, request), request.url.host,
                      agent_name=request.headers.get(AGENT_HEADER) or current_agent(),
                      attempt=attempt_of(request.headers), source=source)


def request_state(settings: CaptureSettings, request: Any) -> RolloutState | None:
    """The rollout a request belongs to: the current one, or the one its `x-rollout-id` names."""
    state = current_rollout()
    header_rid = request.headers.get(ROLLOUT_HEADER)
    if state is None and header_rid:
        state = state_for_header(header_rid, settings.store)
    return state


def attempt_of(headers: Any) -> int:
    """Which attempt of a call this request is (the SDKs count their retries in a header), within
    what the store's integer column holds: the header is whatever the client sent."""
    try:
        retries = int(headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        return 1
    return min(max(retries, 0), INT32_MAX - 1) + 1


def begin_call(settings: CaptureSettings, endpoint: str, payload: dict[str, Any], body: bytes,
               state: RolloutState | None, host: str, *, agent_name: str | None = None,
               attempt: int = 1, source: Source | None = None, idempotency_key: str | None = None
               ) -> tuple[PendingCall | None, bytes | None]:
    """Start recording one call whose body is already parsed: (pending, body to send instead, or None).

    The recording transport enters here for every request it sees; the gateway, which
    has parsed and routed the request itself, enters here directly. None: not recorded.
    """
    served = settings.policy_for(agent_name, state)
    rewritten = served is not None and payload.get("model") != served
    if rewritten:
        payload = {**payload, "model": served}
    if settings.exact_history and state is not None and endpoint == "chat.completions" \
            and isinstance(payload.get("messages"), list):
        restored = state.sampled_turns.restore(payload["messages"])
        if restored is not None:  # sent, and recorded, as the engine will see it
            payload = {**payload, "messages": restored}
            rewritten = True
    if state is None and not settings.record_unattached:
        return None, fastjson.dumps(payload).encode() if rewritten else None
    additions = _additions(settings, endpoint, payload, state, host)
    pending = PendingCall(
        settings=settings, endpoint=endpoint, state=state,
        call_index=state.next_call_index() if state is not None else settings._unattached_counter(),
        attempt=attempt, agent_name=agent_name, body=body, payload=payload, added=frozenset(additions),
        source=source, idempotency_key=idempotency_key,
    )
    if endpoint not in TRAINABLE_ENDPOINTS:
        _warn_once(endpoint, "%s calls sent untranslated are recorded but carry no token IDs: leave translation "
                   "on (wrap(translate=None), the gateway's default) to train on them (docs/formats.md)", endpoint)
    if rewritten:  # a new model or history: serialise once (a rare path; the common one splices bytes)
        return pending, fastjson.dumps({**payload, **additions}).encode()
    return pending, _splice(body, payload, additions) if additions else None


def _additions(settings: CaptureSettings, endpoint: str, payload: dict[str, Any], state: RolloutState | None,
               host: str) -> dict[str, Any]:
    """The fields to add to the request body; the caller's own settings always win."""
    if endpoint not in TRAINABLE_ENDPOINTS or not settings.inject_token_ids or host in settings.no_inject_hosts:
        return {}
    out: dict[str, Any] = {}
    if "return_token_ids" not in payload:
        out["return_token_ids"] = True
    training = state is not None and state.mode == "train"
    # exact_history reads a turn's sampled text from its logprobs: in every mode, so that an
    # evaluation's agent sees the history it wrote, as in training.
    wanted = training or (settings.exact_history and state is not None and endpoint == "chat.completions")
    if settings.inject_logprobs and wanted and "logprobs" not in payload:
        # chat: a boolean; legacy completions: the number of top alternatives (0 = the chosen token only)
        out["logprobs"] = True if endpoint == "chat.completions" else 0
    return out


def _splice(body: bytes, payload: dict[str, Any], additions: dict[str, Any]) -> bytes:
    """Add top-level fields to a JSON object body without re-serialising it.

    `payload` is the parsed body, so the body is known to be one JSON object and
    the new keys known to be absent: inserting before its closing brace is exact.
    """
    extra = json.dumps(additions)[1:-1].encode()
    if not payload:
        return b"{" + extra + b"}"
    end = body.rindex(b"}")
    return body[:end] + b"," + extra + body[end:]


def _policy_version_of(headers: Any) -> int | None:
    """The version a gateway upstream stamped; a header that is no version (the store's column is a
    32-bit integer) is none."""
    value = None if headers is None else headers.get("x-lightning-policy-version")
    try:
        version = int(value) if value is not None else None
    except ValueError:
        return None
    return version if version is not None and 0 <= version <= INT32_MAX else None
