"""The gateway: an OpenAI-compatible capturing proxy in front of vLLM replicas.

Agents in any language point their OpenAI base URL at the gateway; every chat /
completions call is recorded into the trace store with exact token IDs by the
same capture code `wrap()` installs (`capture.begin_call`: token-ID injection,
the record built on the store's writer thread). The proxy routes are served by a
raw ASGI handler and forwarded with one aiohttp session: the per-call path runs
no router, middleware or request/response objects it does not need, because on a
2-core machine each one shows up in the latency a caller sees.

    lightning-mw gateway --upstream http://127.0.0.1:8000/v1 --store sqlite:///traces.db

HTTP surface (see docs/gateway.md):

- `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, also under
  a per-rollout base URL `/rollouts/{id}/v1/...`, or with an `x-rollout-id` header.
  Streaming (SSE) is passed through chunk by chunk.
- `POST /rollouts` (idempotent on a client-supplied `id`), `GET /rollouts/{id}`,
  `POST /rollouts/{id}/reward`, `POST /rollouts/{id}/finish`, `POST /rollouts/{id}/fail`.
- `POST /admin/pause`, `POST /admin/resume`, `GET /admin/state` (weight swaps),
  `GET /health` (no auth).

Training safety: an `Idempotency-Key` request header replays the stored response
(one upstream call, one training call), and identical bodies resent within a
rollout while the first is in flight or within `retry_window_s` after it
succeeded are answered from the first (a client's retry storm stays one call).

Heavy imports (starlette, uvicorn, aiohttp) happen inside functions: importing this
module (the CLI does, to register its subcommand) stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import itertools
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from . import _json
from .capture import CaptureSettings, attempt_of, begin_call, scrub_secrets
from .context import AGENT_HEADER, RolloutState
from .records import Mode, Reward, Rollout, RolloutStatus
from .store import StoreError, TraceStore, get_store

log = logging.getLogger(__name__)

POLICY_HEADER = "x-lightning-policy-version"
UPSTREAM_HEADER = "x-lightning-upstream"
REPLAY_HEADER = "x-lightning-replayed"
ROLLOUT_HEADER = "x-rollout-id"
TOKEN_ENV = "LIGHTNING_GATEWAY_TOKEN"
_PV_EXT = "lightning_policy_version"
_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")

# Never sent upstream as the client sent them (Authorization is replaced per policy).
_DROP_REQUEST_HEADERS = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
    "proxy-authorization", "proxy-connection", "authorization", "cookie", "x-api-key", "api-key",
    "idempotency-key", ROLLOUT_HEADER, AGENT_HEADER, "accept-encoding", "expect",
})
_DROP_RESPONSE_HEADERS = frozenset({
    b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"date", b"server", b"content-encoding",
})
_JSON_HEADERS = [(b"content-type", b"application/json")]


class GatewayConfigError(ValueError):
    """The gateway was configured unsafely or inconsistently; the message says what to fix."""


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type, code, headers or {}

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type, "code": self.code or self.status}}
                          ).encode()

    def reply(self) -> "_Full":
        return _Full(self.status, [*_JSON_HEADERS, *((k.lower().encode("latin-1"), v.encode("latin-1"))
                                                     for k, v in self.headers.items())], self.body())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------
# Upstreams
# --------------------------------------------------------------------------

@dataclass
class Upstream:
    index: int
    url: str  # root, without /v1
    healthy: bool = True
    host: str = field(init=False)  # where capture's per-host injection switch applies
    last_check: float | None = None
    last_error: str | None = None
    active: int = 0

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        self.host = urlsplit(self.url).hostname or ""
        self._endpoints: dict[str, Any] = {}

    def endpoint(self, path: str) -> Any:
        """`{url}/v1/{path}` as a parsed URL, parsed once (aiohttp would parse the string every call)."""
        url = self._endpoints.get(path)
        if url is None:
            from yarl import URL

            url = self._endpoints[path] = URL(f"{self.url}/v1/{path}")
        return url

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "healthy": self.healthy, "last_check": self.last_check,
                "last_error": self.last_error, "active": self.active}


def _root_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        raise GatewayConfigError(f"upstream must be an http(s) URL, got {url!r}")
    return url[:-3] if url.endswith("/v1") else url


def _rendezvous(key: str, upstreams: list[Upstream]) -> Upstream:
    """Highest-random-weight choice: stable per key, and only the keys of a lost replica move."""
    return max(upstreams, key=lambda u: hashlib.blake2b(f"{key}|{u.url}".encode(), digest_size=8).digest())


# --------------------------------------------------------------------------
# Dedup / idempotency: one upstream call per logical call
# --------------------------------------------------------------------------

@dataclass
class _Cached:
    status: int
    headers: list[tuple[bytes, bytes]]  # as sent to the caller (ASGI form)
    body: bytes


@dataclass
class _Flight:
    body_hash: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: _Cached | None = None
    finished_at: float = 0.0
    ttl: float = 0.0


@dataclass
class _RolloutEntry:
    state: RolloutState
    finished: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


# --------------------------------------------------------------------------
# Upstream failures, named as callers know them
# --------------------------------------------------------------------------

def _failure_name(exc: BaseException) -> str:
    """A short, stable name for an upstream failure (recorded in the call's error, and in the 5xx)."""
    import aiohttp

    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "ConnectTimeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "ConnectError"
    if isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return "ReadTimeout"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return "RemoteProtocolError"
    return type(exc).__name__


def _unreachable(exc: BaseException) -> bool:
    """Nothing reached the replica (so another one may be tried)."""
    import aiohttp

    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


# --------------------------------------------------------------------------
# The gateway
# --------------------------------------------------------------------------

class Gateway:
    """The gateway's state and ASGI app; `start()` serves it on uvicorn in a background thread.

    `pause()`, `resume()` and `state()` are thread-safe (the weight publisher calls
    them from its own thread); `apause()` & co. are their coroutine forms.
    """

    def __init__(
        self,
        upstreams: list[str] | str,
        store: TraceStore | str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        upstream_api_key: str | None = None,
        max_body_bytes: int = 16 * 1024 * 1024,
        pause_mode: str = "wait",
        pause_wait_s: float = 30.0,
        retry_after_s: int = 2,
        connect_timeout_s: float = 5.0,
        upstream_timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 2.0,
        retry_window_s: float = 30.0,
        idempotency_ttl_s: float = 3600.0,
        max_cached_responses: int = 1024,
        record_unattached: bool = True,
        policy_version: int | None = None,
    ) -> None:
        if isinstance(upstreams, str):
            upstreams = [upstreams]
        if not upstreams:
            raise GatewayConfigError("at least one --upstream URL is needed")
        if pause_mode not in ("wait", "reject"):
            raise GatewayConfigError(f"pause_mode must be 'wait' or 'reject', got {pause_mode!r}")
        if not _is_loopback(host) and not token:
            raise GatewayConfigError(
                f"refusing to listen on {host} without a bearer token: pass --token (or set {TOKEN_ENV}), "
                "or bind 127.0.0.1")
        if max_body_bytes <= 0:
            raise GatewayConfigError("max_body_bytes must be positive")
        self.upstreams = [Upstream(i, _root_url(u)) for i, u in enumerate(upstreams)]
        self.store = get_store(store)
        self.host, self.port, self.token = host, port, token
        self.upstream_api_key = upstream_api_key
        self.max_body_bytes = max_body_bytes
        self.pause_mode, self.pause_wait_s, self.retry_after_s = pause_mode, pause_wait_s, retry_after_s
        self.connect_timeout_s, self.upstream_timeout_s = connect_timeout_s, upstream_timeout_s
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.retry_window_s, self.idempotency_ttl_s = retry_window_s, idempotency_ttl_s
        self.max_cached_responses = max_cached_responses
        self.record_unattached = record_unattached
        if policy_version is None:  # continue from the newest checkpoint the trainer recorded
            try:
                policy_version = self.store.latest_policy_version()
            except Exception:  # noqa: BLE001 - a fresh store, or one that is down: start unversioned
                policy_version = None
        self.policy_version = policy_version

        self._paused = False
        self._in_flight = 0
        self._resumed: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._rollouts: dict[str, _RolloutEntry] = {}
        self._flights: OrderedDict[tuple[str, ...], _Flight] = OrderedDict()
        self._rr = itertools.count()
        self._session: Any = None  # one aiohttp.ClientSession for every upstream request
        self._call_timeout: Any = None
        self._capture: CaptureSettings | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.counters = {"calls": 0, "replayed": 0, "rejected_paused": 0, "upstream_errors": 0}

    # -- lifecycle ------------------------------------------------------------
    @property
    def app(self) -> Any:
        if self._app is None:
            self._app = _App(self, _build_starlette(self))
        return self._app

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def rollout_base_url(self, rollout_id: str) -> str:
        return f"{self.url}/rollouts/{rollout_id}/v1"

    def _events(self) -> None:
        if self._resumed is None:
            self._loop = asyncio.get_running_loop()
            self._resumed, self._idle = asyncio.Event(), asyncio.Event()
            self._resumed.set()
            self._idle.set()

    async def startup(self) -> None:
        import aiohttp

        self._events()
        if self._session is None:
            # aiohttp: its C HTTP parser and cheap pool cost a fraction of httpx/httpcore's
            # pure-Python h11 per call. Bodies arrive decoded, so capture sees plain bytes.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=0),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar())
            self._call_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                                       sock_read=self.upstream_timeout_s)
            # strip_added=False: gateway callers get the engine's token IDs and logprobs too.
            self._capture = CaptureSettings(store=self.store, record_unattached=self.record_unattached,
                                            strip_added=False)
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(BaseException):
                await self._health_task
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.to_thread(self.store.flush, 10.0)

    def start(self, timeout: float = 30.0) -> "Gateway":
        """Serve on uvicorn in a daemon thread; returns once it accepts connections."""
        import uvicorn

        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="lightning-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start (see the log)")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()

    # -- admin (coroutines, on the gateway's loop) ---------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "paused": self._paused, "pause_mode": self.pause_mode, "in_flight": self._in_flight,
            "policy_version": self.policy_version, "open_rollouts": sum(not e.finished for e in self._rollouts.values()),
            "upstreams": [u.as_dict() for u in self.upstreams], "counters": dict(self.counters),
        }

    async def apause(self, *, wait: bool = True, timeout: float = 60.0, mode: str | None = None) -> dict[str, Any]:
        """Stop admitting calls; with `wait`, return once in-flight calls have finished (or `timeout`)."""
        self._events()
        if mode is not None:
            if mode not in ("wait", "reject"):
                raise _HTTPError(400, "mode must be 'wait' or 'reject'")
            self.pause_mode = mode
        self._paused = True
        self._resumed.clear()  # type: ignore[union-attr]
        drained = self._in_flight == 0
        if wait and not drained:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)  # type: ignore[union-attr]
                drained = True
            except asyncio.TimeoutError:
                drained = self._in_flight == 0
        return {**self.snapshot(), "drained": drained}

    async def aresume(self, *, policy_version: int | None = None) -> dict[str, Any]:
        self._events()
        if policy_version is not None:
            self.policy_version = policy_version
        self._paused = False
        self._resumed.set()  # type: ignore[union-attr]
        return self.snapshot()

    # -- admin (thread-safe) --------------------------------------------------
    def _call_in_loop(self, coro: Any, timeout: float | None) -> Any:
        loop = self._loop
        if loop is None or not loop.is_running():
            coro.close()
            raise RuntimeError("the gateway is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("called on the gateway's own event loop: await apause()/aresume() instead")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def pause(self, *, wait: bool = True, timeout: float = 60.0, mode: str | None = None) -> dict[str, Any]:
        return self._call_in_loop(self.apause(wait=wait, timeout=timeout, mode=mode), timeout + 10)

    def resume(self, *, policy_version: int | None = None) -> dict[str, Any]:
        return self._call_in_loop(self.aresume(policy_version=policy_version), 10)

    def state(self) -> dict[str, Any]:
        return self.snapshot()

    # -- admission ------------------------------------------------------------
    async def _admit(self) -> int | None:
        """Wait out a pause (or refuse); count the call in flight. Returns the policy version serving it."""
        self._events()
        if self._paused:
            retry = {"Retry-After": str(self.retry_after_s)}
            if self.pause_mode == "reject":
                self.counters["rejected_paused"] += 1
                raise _HTTPError(429, "the gateway is paused for a weight update; retry later",
                                 type="paused", headers=retry)
            deadline = time.monotonic() + self.pause_wait_s
            while self._paused:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise asyncio.TimeoutError
                    await asyncio.wait_for(self._resumed.wait(), left)  # type: ignore[union-attr]
                except asyncio.TimeoutError:
                    self.counters["rejected_paused"] += 1
                    raise _HTTPError(429, f"the gateway stayed paused for {self.pause_wait_s:g}s (weight update); "
                                     "retry later", type="paused", headers=retry) from None
        self._in_flight += 1
        self._idle.clear()  # type: ignore[union-attr]
        return self.policy_version

    def _release(self) -> None:
        self._in_flight -= 1
        if self._in_flight <= 0:
            self._in_flight = 0
            self._idle.set()  # type: ignore[union-attr]

    # -- upstream choice and health ------------------------------------------
    def _pick(self, rollout_id: str | None, tried: set[int]) -> Upstream | None:
        left = [u for u in self.upstreams if u.index not in tried]
        if not left:
            return None
        healthy = [u for u in left if u.healthy] or left
        if len(healthy) == 1:
            return healthy[0]
        if rollout_id:
            return _rendezvous(rollout_id, healthy)
        return healthy[next(self._rr) % len(healthy)]

    async def _check(self, u: Upstream) -> None:
        import aiohttp

        try:
            async with self._session.get(u.url + "/health",
                                         timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as r:
                ok, err = r.status == 200, None if r.status == 200 else f"health HTTP {r.status}"
        except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
            ok, err = False, f"{_failure_name(exc)}: {exc}"
        if ok != u.healthy:
            log.warning("upstream %s is now %s%s", u.url, "healthy" if ok else "unhealthy", f" ({err})" if err else "")
        u.healthy, u.last_error, u.last_check = ok, err, time.time()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.upstreams))

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # pragma: no cover - never let the loop die
                log.exception("health check failed")
            await asyncio.sleep(self.health_interval_s)

    # -- rollouts -------------------------------------------------------------
    async def _entry(self, rollout_id: str, *, for_call: bool) -> _RolloutEntry:
        entry = self._rollouts.get(rollout_id)
        if entry is None:
            if not _ID_RE.match(rollout_id):
                raise _HTTPError(400, "rollout ids are 1-64 characters of A-Z a-z 0-9 . _ : -", code="bad_rollout_id")
            stored = await asyncio.to_thread(self.store.get_rollout, rollout_id)
            if stored is None:
                raise _HTTPError(404, f"no rollout {rollout_id!r}: create it first with POST /rollouts",
                                 code="rollout_not_found")
            entry = self._rollouts.get(rollout_id)  # created meanwhile?
            if entry is None:
                state = RolloutState(stored.id, stored.task_id, stored.mode, self.store, stored.policy_version)
                if stored.status == RolloutStatus.RUNNING.value:
                    # Opened before a restart or by another gateway: continue its call numbering.
                    calls = await asyncio.to_thread(self.store.calls, rollout_id)
                    start = max((c.call_index for c in calls), default=-1) + 1
                    state._counter = itertools.count(start)
                entry = _RolloutEntry(state, finished=stored.status != RolloutStatus.RUNNING.value)
                entry.idle.set()
                if not entry.finished:
                    self._rollouts[rollout_id] = entry
        if for_call and entry.finished:
            raise _HTTPError(409, f"rollout {rollout_id!r} is finished; it takes no more calls", code="rollout_finished")
        return entry

    async def create_rollout(self, body: dict[str, Any]) -> tuple[Rollout, bool]:
        task_id = body.get("task_id")
        if not isinstance(task_id, str) or not task_id or len(task_id) > 255:
            raise _HTTPError(400, "task_id (a non-empty string, at most 255 characters) is required", code="bad_task_id")
        rid = body.get("id") if body.get("id") is not None else body.get("rollout_id")
        if rid is None:
            import uuid

            rid = uuid.uuid4().hex
        if not isinstance(rid, str) or not _ID_RE.match(rid):
            raise _HTTPError(400, "id must be 1-64 characters of A-Z a-z 0-9 . _ : -", code="bad_rollout_id")
        mode = body.get("mode", Mode.TRAIN.value)
        if mode not in (Mode.TRAIN.value, Mode.VAL.value):
            raise _HTTPError(400, f"mode must be 'train' or 'val', got {mode!r}", code="bad_mode")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise _HTTPError(400, "metadata must be an object", code="bad_metadata")
        rollout = Rollout(id=rid, task_id=task_id, mode=mode, input=body.get("input"), metadata=metadata,
                          policy_version=self.policy_version, created_at=time.time())
        stored, created = await asyncio.to_thread(self.store.create_rollout, rollout)
        if not created and (stored.task_id != task_id or stored.mode != mode):
            raise _HTTPError(409, f"rollout {rid!r} exists with task_id={stored.task_id!r} mode={stored.mode!r}",
                             code="rollout_conflict")
        if created:
            entry = _RolloutEntry(RolloutState(rid, task_id, mode, self.store, self.policy_version))
            entry.idle.set()
            self._rollouts[rid] = entry
        return stored, created

    async def add_reward(self, rollout_id: str, body: dict[str, Any]) -> Reward:
        entry = await self._entry(rollout_id, for_call=False)
        if entry.finished:
            raise _HTTPError(409, f"rollout {rollout_id!r} is finished; send the reward before finishing it",
                             code="rollout_finished")
        reward = _reward_from(rollout_id, body)
        await asyncio.to_thread(self.store.add_reward, reward)
        return reward

    async def finish_rollout(self, rollout_id: str, body: dict[str, Any], *, default_status: str) -> Rollout:
        status = body.get("status", default_status)
        if status not in (RolloutStatus.SUCCEEDED.value, RolloutStatus.FAILED.value, RolloutStatus.TIMEOUT.value):
            raise _HTTPError(400, "status must be 'succeeded', 'failed' or 'timeout'", code="bad_status")
        error = body.get("error")
        if error is not None and not isinstance(error, str):
            error = json.dumps(error)[:4000]
        entry = await self._entry(rollout_id, for_call=False)
        if entry.finished:
            stored = await asyncio.to_thread(self.store.get_rollout, rollout_id)
            if stored is not None and stored.status == status:
                return stored  # a retried finish
            raise _HTTPError(409, f"rollout {rollout_id!r} is already finished ({stored.status if stored else '?'})",
                             code="rollout_finished")
        reward = _reward_from(rollout_id, {"value": body["reward"]}) if body.get("reward") is not None else None
        entry.finished = True  # new calls get 409 from here on
        try:
            await asyncio.wait_for(entry.idle.wait(), self.upstream_timeout_s)
        except asyncio.TimeoutError:
            log.warning("rollout %s finished with calls still in flight", rollout_id)
        if reward is not None:
            await asyncio.to_thread(self.store.add_reward, reward)
        await asyncio.to_thread(self.store.flush, 30.0)  # its calls are on disk before it shows as finished
        done = await asyncio.to_thread(self.store.finish_rollout, rollout_id, status=status, error=error)
        self._rollouts.pop(rollout_id, None)
        return done

    # -- dedup ----------------------------------------------------------------
    def _evict(self) -> None:
        """Drop expired or surplus cached responses from the oldest end; a few per call (amortised)."""
        now = time.monotonic()
        for _ in range(8):
            if not self._flights:
                return
            key, fl = next(iter(self._flights.items()))
            over = len(self._flights) > self.max_cached_responses
            if not fl.done.is_set():
                if not over:
                    return
                self._flights.move_to_end(key)  # in flight: never dropped
                continue
            if over or now - fl.finished_at > fl.ttl:
                self._flights.popitem(last=False)
                continue
            return

    # -- the proxied call -----------------------------------------------------
    async def serve_proxy(self, scope: dict[str, Any], receive: Any, send: Any, path: str,
                          rollout_id: str | None) -> None:
        """Serve one POST to a proxy route (`path` is "chat/completions" or "completions")."""
        pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        try:
            headers = dict(pairs)
            self.check_auth(headers.get("authorization", ""))
            reply = await self.proxy(pairs, headers, receive, path, rollout_id)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
            reply = _error_reply(exc, "POST", scope["path"])
        await reply(scope, receive, send)

    def check_auth(self, authorization: str) -> None:
        if not self.token:
            return
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise _HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                             type="authentication_error", code="unauthorized",
                             headers={"WWW-Authenticate": "Bearer"})

    async def proxy(self, pairs: list[tuple[str, str]], headers: dict[str, str], receive: Any, path: str,
                    rollout_id: str | None) -> Any:
        """Admit, deduplicate, record and forward one call. Returns the ASGI response to send;
        raises `_HTTPError` while nothing has been sent yet."""
        header_rid = headers.get(ROLLOUT_HEADER)
        if header_rid and rollout_id and header_rid != rollout_id:
            raise _HTTPError(400, f"x-rollout-id {header_rid!r} disagrees with the URL's rollout {rollout_id!r}",
                             code="rollout_mismatch")
        rollout_id = rollout_id or header_rid or None
        raw = await _receive_body(receive, headers, self.max_body_bytes)
        try:
            payload = _json.loads(raw)  # orjson; the standard library below only for what it rejects
        except ValueError:
            try:
                payload = json.loads(raw)  # e.g. integers beyond 64 bits
            except (ValueError, UnicodeDecodeError) as exc:
                raise _HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise _HTTPError(400, "request body must be a JSON object", code="invalid_json")
        payload, scrubbed = scrub_secrets(payload)
        if scrubbed:
            raw = _json.dumps(payload).encode()
        entry = await self._entry(rollout_id, for_call=True) if rollout_id else None
        stream = bool(payload.get("stream"))
        body_hash = hashlib.sha256(raw).hexdigest()

        key: tuple[str, ...] | None = None
        ttl = 0.0
        idem = headers.get("idempotency-key")
        if idem:
            key, ttl = ("idem", rollout_id or "", idem), self.idempotency_ttl_s
        elif rollout_id and self.retry_window_s > 0:
            key, ttl = ("body", rollout_id, path, body_hash), self.retry_window_s

        flight: _Flight | None = None
        if key is not None:
            while True:
                found = self._flights.get(key)
                if found is not None and found.body_hash != body_hash:
                    raise _HTTPError(409, "Idempotency-Key reused with a different request body",
                                     code="idempotency_conflict")
                if found is None or (found.done.is_set() and (
                        found.result is None or time.monotonic() - found.finished_at > found.ttl)):
                    flight = _Flight(body_hash, ttl=ttl)
                    self._flights[key] = flight
                    self._flights.move_to_end(key)
                    self._evict()
                    break
                if not found.done.is_set():
                    try:  # the first copy is still running: wait for its answer
                        await asyncio.wait_for(found.done.wait(), self.upstream_timeout_s + self.pause_wait_s + 30)
                    except asyncio.TimeoutError:
                        raise _HTTPError(504, "an identical earlier request is still running upstream",
                                         type="upstream_timeout", code="upstream_timeout") from None
                    continue
                self.counters["replayed"] += 1
                cached = found.result
                assert cached is not None
                return _Full(cached.status, cached.headers + [(REPLAY_HEADER.encode(), b"1")], cached.body)

        ok_result: _Cached | None = None
        admitted = False
        try:
            version = await self._admit()
            admitted = True
            if entry is not None:
                entry.in_flight += 1
                entry.idle.clear()
            self.counters["calls"] += 1
            call = await self._forward(pairs, headers, path, raw, payload, rollout_id, entry, version)
            status = call.response.status
            if not stream or not 200 <= status < 300 or "text/event-stream" not in call.content_type:
                try:
                    body = await call.response.read()
                except Exception as exc:
                    call.record([], error=exc)
                    raise _upstream_exc(exc, call.where) from None
                finally:
                    call.response.release()
                call.record([body])
                if status >= 500:
                    self.counters["upstream_errors"] += 1
                    raise _HTTPError(502, f"upstream {call.where} answered HTTP {status}: "
                                     f"{body[:500].decode('utf-8', 'replace')}",
                                     type="upstream_error", code="upstream_error")
                if 200 <= status < 300:
                    ok_result = _Cached(status, call.headers, body)
                return _Full(status, call.headers, body)
            # A stream: take its first chunk before committing to 200, so a stalled upstream is a 504.
            chunks = call.response.content.iter_any()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except Exception as exc:
                call.response.close()
                call.record([], error=exc)
                raise _upstream_exc(exc, call.where) from None

            def on_done(complete: bool, sent: list[bytes]) -> None:
                call.record(sent)  # an incomplete stream is recorded as a partial call
                if entry is not None:
                    _leave(entry)
                self._release()
                if flight is not None:
                    self._land(key, flight, _Cached(status, call.headers, b"".join(sent)) if complete else None)

            admitted = False  # the stream releases its slot when it ends
            return _StreamResponse(status, call.headers, first, chunks, call.response, on_done)
        except BaseException:
            if flight is not None:
                self._land(key, flight, None)
                flight = None
            raise
        finally:
            if admitted:
                if entry is not None:
                    _leave(entry)
                self._release()
                if flight is not None:
                    self._land(key, flight, ok_result)

    def _land(self, key: tuple[str, ...] | None, flight: _Flight, result: _Cached | None) -> None:
        if flight.done.is_set():
            return
        flight.result = result
        flight.finished_at = time.monotonic()
        flight.done.set()
        if result is None and key is not None and self._flights.get(key) is flight:
            del self._flights[key]  # a failed call is not replayed: the retry goes upstream

    async def _forward(self, pairs: list[tuple[str, str]], headers: dict[str, str], path: str, raw: bytes,
                       payload: dict[str, Any], rollout_id: str | None, entry: _RolloutEntry | None,
                       version: int | None) -> "_Upstreamed":
        """Record and send the call to a replica (sticky per rollout; the next one if it can't be reached)."""
        if self._session is None:
            await self.startup()
        out = [(k, v) for k, v in pairs if k not in _DROP_REQUEST_HEADERS]
        out.append(("accept-encoding", "identity"))  # plain bytes for capture, no compression on loopback
        auth = self.upstream_api_key and f"Bearer {self.upstream_api_key}"
        if not auth and not self.token:
            auth = headers.get("authorization")  # a transparent proxy: the upstream's own key
        if auth:
            out.append(("authorization", auth))
        endpoint = "chat.completions" if path == "chat/completions" else "completions"
        state = entry.state if entry is not None else None
        tried: set[int] = set()
        while True:
            up = self._pick(rollout_id, tried)
            if up is None:
                self.counters["upstream_errors"] += 1
                raise _HTTPError(502, "no upstream reachable: " + "; ".join(
                    f"{u.url}: {u.last_error}" for u in self.upstreams if u.index in tried),
                    type="upstream_error", code="upstream_unreachable")
            tried.add(up.index)
            try:  # every attempt is recorded; recording never fails the call
                pending, new_body = begin_call(self._capture, endpoint, payload, raw, state, up.host,  # type: ignore[arg-type]
                                               agent_name=headers.get(AGENT_HEADER), attempt=attempt_of(headers))
            except Exception:
                log.exception("capture failed before sending; forwarding unrecorded")
                pending, new_body = None, None
            url = up.endpoint(path)
            up.active += 1
            try:
                response = await self._session.post(url, data=raw if new_body is None else new_body, headers=out,
                                                    allow_redirects=False, timeout=self._call_timeout)
                if pending is not None and pending.rejected(response.status, up.host):
                    response.release()  # resend as the caller wrote it
                    response = await self._session.post(url, data=raw, headers=out, allow_redirects=False,
                                                        timeout=self._call_timeout)
            except BaseException as exc:  # CancelledError too: the attempt is recorded as failed
                if pending is not None:
                    pending.finish(error=f"{_failure_name(exc)}: {exc}")
                if isinstance(exc, Exception) and _unreachable(exc):
                    # Nothing reached this replica: mark it down and try another.
                    up.healthy, up.last_error, up.last_check = False, f"{_failure_name(exc)}: {exc}", time.time()
                    log.warning("upstream %s unreachable (%s); trying another", up.url, exc)
                    continue
                if isinstance(exc, Exception):
                    raise _upstream_exc(exc, up.url) from None
                raise
            finally:
                up.active -= 1
            reply_headers = _reply_headers(response.raw_headers)
            if version is not None:
                reply_headers.append((POLICY_HEADER.encode(), str(version).encode()))
            reply_headers.append((UPSTREAM_HEADER.encode(), str(up.index).encode()))
            return _Upstreamed(response, reply_headers, pending, up.url, version)

    async def forward_get(self, path: str) -> Any:
        if self._session is None:
            await self.startup()
        headers = {"authorization": f"Bearer {self.upstream_api_key}"} if self.upstream_api_key else None
        tried: set[int] = set()
        while True:
            up = self._pick(None, tried)
            if up is None:
                raise _HTTPError(502, "no upstream reachable", type="upstream_error", code="upstream_unreachable")
            tried.add(up.index)
            try:
                async with self._session.get(up.url + "/v1/" + path, headers=headers,
                                             timeout=self._call_timeout) as r:
                    body = await r.read()
                    status = r.status
                    reply_headers = _reply_headers(r.raw_headers)
            except Exception as exc:  # noqa: BLE001
                up.healthy, up.last_error = False, f"{_failure_name(exc)}: {exc}"
                continue
            return _Full(status if status < 500 else 502, reply_headers, body)


class _Upstreamed:
    """An upstream's answer to one recorded attempt, before its body is read."""

    __slots__ = ("response", "headers", "pending", "where", "version", "content_type")

    def __init__(self, response: Any, headers: list[tuple[bytes, bytes]], pending: Any, where: str,
                 version: int | None) -> None:
        self.response, self.headers, self.pending, self.where, self.version = response, headers, pending, where, version
        self.content_type = response.headers.get("content-type", "")

    def record(self, chunks: list[bytes], error: BaseException | None = None) -> None:
        """Hand the attempt to capture (parsed into a record on the store's writer thread)."""
        if self.pending is None:
            return
        meta = {"content-type": self.content_type}
        if self.version is not None:
            meta[POLICY_HEADER] = str(self.version)
        self.pending.finish(status_code=None if error is not None else self.response.status, chunks=chunks,
                            headers=meta, error=None if error is None else f"{_failure_name(error)}: {error}")


def _leave(entry: _RolloutEntry) -> None:
    entry.in_flight -= 1
    if entry.in_flight <= 0:
        entry.in_flight = 0
        entry.idle.set()


def _reward_from(rollout_id: str, body: dict[str, Any]) -> Reward:
    value = body.get("value", body.get("reward"))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _HTTPError(400, f"reward value must be a finite number, got {value!r}", code="bad_reward")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise _HTTPError(400, "metadata must be an object", code="bad_metadata")
    name = body.get("name")
    return Reward(rollout_id=rollout_id, value=float(value), name=str(name) if name is not None else None,
                  final=bool(body.get("final", True)), created_at=time.time(), metadata=metadata)


def _upstream_exc(exc: BaseException, where: str | None) -> _HTTPError:
    name = _failure_name(exc)
    if name.endswith("Timeout"):
        return _HTTPError(504, f"upstream {where or '?'} timed out ({name})", type="upstream_timeout",
                          code="upstream_timeout")
    return _HTTPError(502, f"upstream {where or '?'} failed: {name}: {exc}", type="upstream_error",
                      code="upstream_error")


def _error_reply(exc: BaseException, method: str, path: str) -> "_Full":
    """The JSON error a failed request gets: its own status for `_HTTPError`, 503 when the trace store
    is down (retry later), 500 (logged) for anything else."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, _HTTPError):
        return exc.reply()
    if isinstance(exc, (StoreError, sa_exc.SQLAlchemyError)):
        log.warning("trace store error on %s %s: %s", method, path, exc)
        return _HTTPError(503, "the trace store is unavailable; retry later", type="store_unavailable",
                          code="store_unavailable", headers={"Retry-After": "5"}).reply()
    log.error("gateway error on %s %s", method, path, exc_info=exc)
    return _HTTPError(500, f"gateway error: {type(exc).__name__}", type="server_error").reply()


def _reply_headers(raw: Any) -> list[tuple[bytes, bytes]]:
    """An upstream response's headers as passed on to the caller (ASGI form, hop-by-hop ones dropped)."""
    out = []
    for k, v in raw:
        k = k.lower()
        if k not in _DROP_RESPONSE_HEADERS:
            out.append((k, v))
    return out


async def _receive_body(receive: Any, headers: Any, limit: int) -> bytes:
    """The request body from raw ASGI messages, within `limit` bytes."""
    _check_declared(headers.get("content-length"), limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _HTTPError(400, "the client went away while sending its request", code="client_disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _HTTPError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _check_declared(declared: str | None, limit: int) -> None:
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise _HTTPError(400, "bad Content-Length", code="bad_content_length") from None
    if size > limit:
        raise _HTTPError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")


class _Full:
    """A whole response, as an ASGI app."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [*self.headers, (b"content-length", str(len(self.body)).encode())]})
        await send({"type": "http.response.body", "body": self.body})


class _StreamResponse:
    """An ASGI response that relays an upstream SSE stream chunk by chunk.

    Stops reading upstream (and closes that connection, so the engine stops generating)
    when the client goes away, and reports (complete, chunks relayed) exactly once when done.
    """

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes, chunks: Any, upstream: Any,
                 on_done: Any) -> None:
        self.status, self.headers, self.first, self.chunks = status, headers, first, chunks
        self.upstream, self.on_done = upstream, on_done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        watcher = asyncio.create_task(watch())
        sent: list[bytes] = []
        complete = False
        try:
            await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
            if self.first:
                sent.append(self.first)
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.chunks:
                if gone.is_set():
                    break
                sent.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:
                complete = not gone.is_set()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:  # upstream died mid-stream: the caller sees the stream end early
            log.warning("stream from upstream ended with %s: %s", type(exc).__name__, exc)
        finally:
            watcher.cancel()
            if complete:
                self.upstream.release()
            else:
                self.upstream.close()
            self.on_done(complete, sent)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # accepted sockets inherit it; with proto 0 every response waits out Nagle + delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.set_inheritable(True)
    return sock


# --------------------------------------------------------------------------
# The ASGI app
# --------------------------------------------------------------------------

_PROXY_SUFFIXES = (("/v1/chat/completions", "chat/completions"), ("/v1/completions", "completions"))


def _proxy_route(path: str) -> tuple[str, str | None] | None:
    """(upstream path, rollout id or None) for `/v1/...` and `/rollouts/{id}/v1/...` proxy routes."""
    for suffix, upstream_path in _PROXY_SUFFIXES:
        if path.endswith(suffix):
            prefix = path[: -len(suffix)]
            if not prefix:
                return upstream_path, None
            rid = prefix[len("/rollouts/"):]
            if prefix.startswith("/rollouts/") and rid and "/" not in rid:
                return upstream_path, rid
    return None


class _App:
    """The gateway's ASGI app. The two proxy routes, which every LLM call takes, are served
    straight from here; the rest (rollouts, admin, health, models) by a Starlette router."""

    def __init__(self, gateway: Gateway, routes: Any) -> None:
        self.gateway, self._routes = gateway, routes
        self.state = routes.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            route = _proxy_route(scope["path"])
            if route is not None:
                if scope["method"] == "POST":
                    await self.gateway.serve_proxy(scope, receive, send, *route)
                else:
                    await _HTTPError(405, f"method {scope['method']} not allowed on {scope['path']}",
                                     code="method_not_allowed").reply()(scope, receive, send)
                return
        await self._routes(scope, receive, send)


def _build_starlette(gw: Gateway) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def endpoint(fn: Any, *, auth: bool = True) -> Any:
        async def handler(request: Request) -> Any:
            try:
                if auth:
                    gw.check_auth(request.headers.get("authorization", ""))
                return await fn(request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
                return _error_reply(exc, request.method, request.url.path)
        return handler

    async def json_body(request: Request, *, optional: bool = False) -> dict[str, Any]:
        raw = await _receive_body(request.receive, request.headers, gw.max_body_bytes)
        if not raw.strip() and optional:
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _HTTPError(400, "request body must be a JSON object", code="invalid_json")
        return body

    def rollout_json(r: Rollout, request: Request) -> dict[str, Any]:
        d = {k: v for k, v in r.__dict__.items()}
        d["base_url"] = str(request.base_url).rstrip("/") + f"/rollouts/{r.id}/v1"
        return d

    async def models(request: Request) -> Any:
        rid = request.path_params.get("rid")
        if rid:
            await gw._entry(rid, for_call=False)
        return await gw.forward_get("models")

    async def create(request: Request) -> Any:
        stored, created = await gw.create_rollout(await json_body(request))
        return JSONResponse({**rollout_json(stored, request), "created": created}, status_code=201 if created else 200)

    async def get_rollout(request: Request) -> Any:
        rid = request.path_params["rid"]
        stored = await asyncio.to_thread(gw.store.get_rollout, rid)
        if stored is None:
            raise _HTTPError(404, f"no rollout {rid!r}", code="rollout_not_found")
        entry = gw._rollouts.get(rid)
        return JSONResponse({**rollout_json(stored, request), "in_flight": entry.in_flight if entry else 0})

    async def reward(request: Request) -> Any:
        r = await gw.add_reward(request.path_params["rid"], await json_body(request))
        return JSONResponse({"rollout_id": r.rollout_id, "value": r.value, "name": r.name, "final": r.final})

    async def finish(request: Request) -> Any:
        done = await gw.finish_rollout(request.path_params["rid"], await json_body(request, optional=True),
                                       default_status=RolloutStatus.SUCCEEDED.value)
        return JSONResponse(rollout_json(done, request))

    async def fail(request: Request) -> Any:
        done = await gw.finish_rollout(request.path_params["rid"], await json_body(request, optional=True),
                                       default_status=RolloutStatus.FAILED.value)
        return JSONResponse(rollout_json(done, request))

    async def pause(request: Request) -> Any:
        body = await json_body(request, optional=True)
        timeout = body.get("timeout", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise _HTTPError(400, "timeout must be a non-negative number of seconds")
        return JSONResponse(await gw.apause(wait=bool(body.get("wait", True)), timeout=float(timeout),
                                            mode=body.get("mode")))

    async def resume(request: Request) -> Any:
        body = await json_body(request, optional=True)
        pv = body.get("policy_version")
        if pv is not None and (isinstance(pv, bool) or not isinstance(pv, int)):
            raise _HTTPError(400, "policy_version must be an integer")
        return JSONResponse(await gw.aresume(policy_version=pv))

    async def state(_request: Request) -> Any:
        return JSONResponse(gw.snapshot())

    async def health(_request: Request) -> Any:
        return JSONResponse({"ok": True, "paused": gw._paused,
                             "healthy_upstreams": sum(u.healthy for u in gw.upstreams)})

    async def not_found(request: Request, _exc: Exception) -> Any:
        err = _HTTPError(404, f"no route {request.method} {request.url.path}", code="not_found")
        return err.reply()

    async def bad_method(request: Request, _exc: Exception) -> Any:
        err = _HTTPError(405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        return err.reply()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    routes = [
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/rollouts", endpoint(create), methods=["POST"]),
        Route("/rollouts/{rid}", endpoint(get_rollout), methods=["GET"]),
        Route("/rollouts/{rid}/reward", endpoint(reward), methods=["POST"]),
        Route("/rollouts/{rid}/finish", endpoint(finish), methods=["POST"]),
        Route("/rollouts/{rid}/fail", endpoint(fail), methods=["POST"]),
        Route("/rollouts/{rid}/v1/models", endpoint(models), methods=["GET"]),
        Route("/admin/pause", endpoint(pause), methods=["POST"]),
        Route("/admin/resume", endpoint(resume), methods=["POST"]),
        Route("/admin/state", endpoint(state), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.state.gateway = gw
    return app


def build_app(upstreams: list[str] | str, store: TraceStore | str | None = None, **options: Any) -> Any:
    """The gateway as an ASGI app (serve it with any ASGI server); `app.gateway` (also `app.state.gateway`)
    is the `Gateway`."""
    return Gateway(upstreams, store, **options).app


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def add_cli(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run the OpenAI-compatible capturing proxy in front of vLLM")
    p.add_argument("--upstream", action="append", required=True, metavar="URL",
                   help="a vLLM OpenAI server, e.g. http://127.0.0.1:8000/v1 (repeat for replicas)")
    p.add_argument("--store", default=None, help="trace store URL (default: $LIGHTNING_STORE_URL or ./lightning_traces.db)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; others need --token)")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--token", default=None, help=f"bearer token clients must send (or set ${TOKEN_ENV})")
    p.add_argument("--upstream-api-key", default=None, help="key sent to the upstreams (or $LIGHTNING_UPSTREAM_API_KEY)")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="request body size limit (default 16)")
    p.add_argument("--pause-mode", choices=("wait", "reject"), default="wait",
                   help="while paused, new calls wait (up to --pause-wait) or get 429 at once")
    p.add_argument("--pause-wait", type=float, default=30.0, help="seconds a call waits out a pause before 429")
    p.add_argument("--upstream-timeout", type=float, default=600.0, help="read timeout per upstream call (504)")
    p.add_argument("--health-interval", type=float, default=5.0)
    p.add_argument("--retry-window", type=float, default=30.0,
                   help="an identical body resent within a rollout this soon after success is answered from it")
    p.add_argument("--policy-version", type=int, default=None, help="policy version served at start")
    p.add_argument("--no-record-unattached", action="store_true", help="don't record calls outside rollouts")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    import uvicorn

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.verbose:  # HTTP clients' per-request INFO logs: noise, and a cost per call
        for name in ("httpx", "httpcore", "aiohttp"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        gw = Gateway(args.upstream, args.store, host=args.host, port=args.port, token=token,
                     upstream_api_key=args.upstream_api_key or os.environ.get("LIGHTNING_UPSTREAM_API_KEY"),
                     max_body_bytes=int(args.max_body_mb * 1024 * 1024), pause_mode=args.pause_mode,
                     pause_wait_s=args.pause_wait, upstream_timeout_s=args.upstream_timeout,
                     health_interval_s=args.health_interval, retry_window_s=args.retry_window,
                     policy_version=args.policy_version, record_unattached=not args.no_record_unattached)
    except (GatewayConfigError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    sock = _bind(args.host, args.port)
    gw.port = sock.getsockname()[1]
    log.info("gateway on %s -> %s, store %s%s", gw.base_url, ", ".join(u.url for u in gw.upstreams),
             gw.store.safe_url, " (token required)" if token else "")
    server = uvicorn.Server(uvicorn.Config(gw.app, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=10))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass
    return 0
