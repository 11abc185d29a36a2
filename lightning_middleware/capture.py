"""The capture transport: one recording mechanism for every framework.

Every supported framework sends its LLM requests through an httpx-style client
(`httpx`, or `httpx2` for openai 3.x). `install()` puts a `RecordingTransport`
in front of that client's transport. For each chat/completions request it:

1. adds `return_token_ids: true` (and `logprobs: true` for training rollouts)
   unless the caller set them, asks for an uncompressed body, and removes our
   routing headers (`x-rollout-id`, `x-agent-name`);
2. forwards the request, and hands back the response with its body stream
   teed: bytes flow to the caller as they arrive while a parser rebuilds text,
   tool calls, token IDs, logprobs and the finish reason on the side;
3. when the body ends or is closed, submits one `LLMCall` to the store's
   background writer (never blocking, never raising into the agent).

If a server rejects the extra fields with a 400, the request is resent once as
the caller wrote it and injection stops for that host: recording must never be
why an agent's call fails.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from ._assemble import Assembled, BodyCollector
from .context import AGENT_HEADER, ROLLOUT_HEADER, RolloutState, current_agent, current_rollout, state_for_header
from .records import LLMCall
from .store import TraceStore

log = logging.getLogger(__name__)

_ENDPOINTS = (("/chat/completions", "chat.completions"), ("/completions", "completions"), ("/responses", "responses"))
_STRIP_HEADERS = (ROLLOUT_HEADER, AGENT_HEADER)
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


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
    # Hosts that answered 400 to the injected fields: leave their requests alone.
    no_inject_hosts: set[str] = field(default_factory=set)
    _unattached_counter: Any = field(default_factory=lambda: _Counter())


class _Counter:
    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._n += 1
            return self._n - 1


# --------------------------------------------------------------------------
# One call in flight
# --------------------------------------------------------------------------

@dataclass
class _Pending:
    settings: CaptureSettings
    endpoint: str
    state: RolloutState | None
    call_index: int
    attempt: int
    agent_name: str | None
    request_json: dict[str, Any]
    request_hash: str
    injected: bool
    started_at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    done: bool = False

    @property
    def store(self) -> TraceStore:
        return self.state.store if self.state is not None else self.settings.store

    def finish(self, *, status_code: int | None, assembled: Assembled | None, error: str | None,
               stream: bool, policy_version: int | None) -> None:
        """Submit the record exactly once. Never raises."""
        if self.done:
            return
        self.done = True
        try:
            self.store.submit_call(self._record(status_code, assembled, error, stream, policy_version))
        except Exception:  # recording must not break the agent
            log.exception("could not record an LLM call")

    def _record(self, status_code: int | None, a: Assembled | None, error: str | None, stream: bool,
                policy_version: int | None) -> LLMCall:
        a = a or Assembled()
        ok = status_code is not None and 200 <= status_code < 300
        has_ids = bool(a.prompt_token_ids) and bool(a.completion_token_ids)
        if ok and a.complete and not has_ids and self.endpoint != "responses":
            _warn_once("no-ids", "the LLM server returned no token IDs (is it vLLM?); calls are recorded "
                       "but can't be trained on")
        return LLMCall(
            id=uuid.uuid4().hex,
            rollout_id=None if self.state is None else self.state.id,
            call_index=self.call_index,
            attempt=self.attempt,
            endpoint=self.endpoint,
            model=self.request_json.get("model") or (a.response or {}).get("model"),
            agent_name=self.agent_name,
            request=self.request_json,
            response=a.response,
            prompt_token_ids=tuple(a.prompt_token_ids),
            completion_token_ids=tuple(a.completion_token_ids),
            logprobs=tuple(a.logprobs) if a.logprobs is not None else None,
            finish_reason=a.finish_reason,
            status_code=status_code,
            stream=stream,
            partial=ok and not a.complete,
            is_training=ok and a.complete and has_ids and self.endpoint != "responses",
            error=error or a.error,
            latency_s=time.perf_counter() - self.t0,
            started_at=self.started_at,
            policy_version=policy_version if policy_version is not None else
            (self.state.policy_version if self.state is not None else None),
            request_hash=self.request_hash,
        )


def _begin(settings: CaptureSettings, request: Any, body: bytes) -> tuple[_Pending | None, bytes | None]:
    """Decide whether to record `request`; returns (pending, new body or None if unchanged)."""
    endpoint = _endpoint_of(request.url.path)
    header_rid = request.headers.get(ROLLOUT_HEADER)
    if endpoint is None or request.method != "POST":
        return None, None
    try:
        payload = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        payload = None
    if not isinstance(payload, dict):
        return None, None
    state = current_rollout()
    if state is None and header_rid:
        state = state_for_header(header_rid, settings.store)
    if state is None and not settings.record_unattached:
        return None, None
    request_hash = hashlib.sha256(body).hexdigest()
    new_payload, injected = _inject(settings, endpoint, payload, state, request.url.host)
    try:
        retries = int(request.headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        retries = 0
    pending = _Pending(
        settings=settings, endpoint=endpoint, state=state,
        call_index=state.next_call_index() if state is not None else settings._unattached_counter(),
        attempt=retries + 1,
        agent_name=request.headers.get(AGENT_HEADER) or current_agent(),
        request_json=payload, request_hash=request_hash, injected=injected,
    )
    if endpoint == "responses":
        _warn_once("responses", "Responses API calls are recorded but vLLM returns no token IDs there; "
                   "use chat.completions for training (see docs)")
    return pending, json.dumps(new_payload).encode() if injected else None


def _inject(settings: CaptureSettings, endpoint: str, payload: dict[str, Any], state: RolloutState | None,
            host: str) -> tuple[dict[str, Any], bool]:
    if endpoint == "responses" or not settings.inject_token_ids or host in settings.no_inject_hosts:
        return payload, False
    out = dict(payload)
    if "return_token_ids" not in out:
        out["return_token_ids"] = True
    training = state is not None and state.mode == "train"
    if settings.inject_logprobs and training and "logprobs" not in out:
        # chat: a boolean; legacy completions: the number of top alternatives (0 = the chosen token only)
        out["logprobs"] = True if endpoint == "chat.completions" else 0
    return out, out != payload


def _forward_headers(request: Any, body_changed: bool) -> list[tuple[str, str]]:
    drop = set(_STRIP_HEADERS) | ({"content-length"} if body_changed else set()) | {"accept-encoding"}
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in drop]
    headers.append(("accept-encoding", "identity"))
    return headers


def _policy_version_of(response: Any) -> int | None:
    value = response.headers.get("x-lightning-policy-version")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _strip_only(request: Any) -> bool:
    return any(h in request.headers for h in _STRIP_HEADERS)


# --------------------------------------------------------------------------
# Transports, built once per HTTP module (httpx, httpx2): same shapes, different classes.
# --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def transport_classes(module: types.ModuleType) -> tuple[type, type]:
    """(sync transport class, async transport class) for an httpx-like module."""

    class TeeStream(module.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, collector: BodyCollector, on_close: Any) -> None:
            self._inner, self._collector, self._on_close = inner, collector, on_close

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._inner:
                _safe_feed(self._collector, chunk)
                yield chunk

        def close(self) -> None:
            try:
                self._inner.close()
            finally:
                self._on_close()

    class AsyncTeeStream(module.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, collector: BodyCollector, on_close: Any) -> None:
            self._inner, self._collector, self._on_close = inner, collector, on_close

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self._inner:
                _safe_feed(self._collector, chunk)
                yield chunk

        async def aclose(self) -> None:
            try:
                await self._inner.aclose()
            finally:
                self._on_close()

    def rebuild(request: Any, body: bytes, changed: bool) -> Any:
        return module.Request(request.method, request.url, headers=_forward_headers(request, changed),
                              content=body, extensions=request.extensions)

    def wrap_response(response: Any, pending: _Pending, tee_cls: type) -> Any:
        content_type = response.headers.get("content-type", "")
        streaming = "text/event-stream" in content_type
        collector = BodyCollector(pending.endpoint, streaming, response.headers.get("content-encoding"))
        status = response.status_code
        pv = _policy_version_of(response)

        def on_close() -> None:
            result = collector.result()
            error = None
            if not 200 <= status < 300:
                error = f"HTTP {status}: {collector.raw_text(500)}" if not streaming else f"HTTP {status}"
            pending.finish(status_code=status, assembled=result, error=error, stream=streaming, policy_version=pv)

        return module.Response(status, headers=response.headers, stream=tee_cls(response.stream, collector, on_close),
                               extensions=response.extensions)

    def tee_or_pass(response: Any, pending: _Pending, tee_cls: type) -> Any:
        try:
            return wrap_response(response, pending, tee_cls)
        except Exception as exc:  # hand the caller the untouched response rather than fail its call
            log.exception("could not tee a response; the call is recorded without its body")
            pending.finish(status_code=response.status_code, assembled=None, error=f"recorder: {exc}",
                           stream=False, policy_version=None)
            return response

    def should_retry_plain(pending: _Pending, response: Any) -> bool:
        return pending.injected and response.status_code == 400

    def note_rejected(settings: CaptureSettings, host: str) -> None:
        settings.no_inject_hosts.add(host)
        _warn_once(f"reject:{host}", "%s rejected return_token_ids/logprobs (not vLLM?); sending requests "
                   "to it unchanged from now on, without token IDs", host)

    class RecordingTransport(module.BaseTransport):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, settings: CaptureSettings) -> None:
            self.inner = inner
            self.settings = settings

        def handle_request(self, request: Any) -> Any:
            try:
                body = request.read()
                pending, new_body = _begin(self.settings, request, body)
            except Exception:
                log.exception("capture failed before sending; forwarding unrecorded")
                pending, new_body = None, None
            if pending is None:
                return self.inner.handle_request(rebuild(request, body, False) if _strip_only(request) else request)
            outgoing = rebuild(request, new_body if new_body is not None else body, new_body is not None)
            try:
                response = self.inner.handle_request(outgoing)
                if should_retry_plain(pending, response):
                    response.close()
                    note_rejected(self.settings, request.url.host)
                    pending.injected = False
                    response = self.inner.handle_request(rebuild(request, body, False))
            except Exception as exc:
                pending.finish(status_code=None, assembled=None, error=f"{type(exc).__name__}: {exc}",
                               stream=False, policy_version=None)
                raise
            return tee_or_pass(response, pending, TeeStream)

        def close(self) -> None:
            self.inner.close()

    class AsyncRecordingTransport(module.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, settings: CaptureSettings) -> None:
            self.inner = inner
            self.settings = settings

        async def handle_async_request(self, request: Any) -> Any:
            try:
                body = await request.aread()
                pending, new_body = _begin(self.settings, request, body)
            except Exception:
                log.exception("capture failed before sending; forwarding unrecorded")
                pending, new_body = None, None
            if pending is None:
                req = rebuild(request, body, False) if _strip_only(request) else request
                return await self.inner.handle_async_request(req)
            outgoing = rebuild(request, new_body if new_body is not None else body, new_body is not None)
            try:
                response = await self.inner.handle_async_request(outgoing)
                if should_retry_plain(pending, response):
                    await response.aclose()
                    note_rejected(self.settings, request.url.host)
                    pending.injected = False
                    response = await self.inner.handle_async_request(rebuild(request, body, False))
            except BaseException as exc:  # CancelledError too: the attempt is recorded as failed
                pending.finish(status_code=None, assembled=None, error=f"{type(exc).__name__}: {exc}",
                               stream=False, policy_version=None)
                raise
            return tee_or_pass(response, pending, AsyncTeeStream)

        async def aclose(self) -> None:
            await self.inner.aclose()

    return RecordingTransport, AsyncRecordingTransport


def _safe_feed(collector: BodyCollector, chunk: bytes) -> None:
    try:
        collector.feed(chunk)
    except Exception:  # a parser bug must not cut the caller's stream
        log.exception("could not parse a response chunk; the call will be recorded without it")


# --------------------------------------------------------------------------
# Installing on an HTTP client
# --------------------------------------------------------------------------

def _http_module(client: Any) -> types.ModuleType | None:
    import sys

    for name in ("httpx2", "httpx"):
        mod = sys.modules.get(name)
        if mod is not None and isinstance(client, (mod.Client, mod.AsyncClient)):
            return mod
    return None


def is_http_client(obj: Any) -> bool:
    return _http_module(obj) is not None


def install(client: Any, settings: CaptureSettings) -> bool:
    """Put a recording transport in front of an httpx/httpx2 client's transports.

    Idempotent: an already-recording transport gets the new settings' store only
    if it was given explicitly (handled by the caller) and is otherwise left as
    it is. Returns True if something was installed now.
    """
    module = _http_module(client)
    if module is None:
        raise TypeError(f"not an httpx or httpx2 client: {type(client).__name__}")
    sync_cls, async_cls = transport_classes(module)
    cls = async_cls if isinstance(client, module.AsyncClient) else sync_cls
    installed = False
    if isinstance(client._transport, cls):
        client._transport.settings = settings
    else:
        client._transport = cls(client._transport, settings)
        installed = True
    for pattern, mounted in list(client._mounts.items()):  # proxies: each mount is a transport too
        if mounted is None:
            continue
        if isinstance(mounted, cls):
            mounted.settings = settings
        else:
            client._mounts[pattern] = cls(mounted, settings)
            installed = True
    return installed


def installed_settings(client: Any) -> CaptureSettings | None:
    module = _http_module(client)
    if module is None:
        return None
    sync_cls, async_cls = transport_classes(module)
    t = client._transport
    return t.settings if isinstance(t, (sync_cls, async_cls)) else None
