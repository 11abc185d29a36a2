"""The gateway: an OpenAI-compatible capturing proxy in front of vLLM replicas.

Agents in any language point their OpenAI base URL at the gateway; every chat /
completions call is recorded into the trace store with exact token IDs, by the
same recording transport `wrap()` uses (in front of the gateway's upstream
connection, aiohttp by default; the rollout passed through the rollout context).

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

Heavy imports (starlette, uvicorn) happen inside functions: importing this
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
from .capture import CaptureSettings, scrub_secrets, transport_classes  # noqa: F401  (scrub_secrets: API)
from .context import RolloutState, _current
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
    "idempotency-key", ROLLOUT_HEADER, "accept-encoding", "expect",
})
_DROP_RESPONSE_HEADERS = frozenset({
    "content-length", "transfer-encoding", "connection", "keep-alive", "date", "server", "content-encoding",
})


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
    last_check: float | None = None
    last_error: str | None = None
    active: int = 0

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
    headers: list[tuple[str, str]]
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
# Stamping the policy version that served a call (read by capture from the response header)
# --------------------------------------------------------------------------

def _stamp_transport_class() -> type:
    import httpx

    class StampTransport(httpx.AsyncBaseTransport):
        """Puts the gateway's policy version for this call on the upstream response, where the
        recording transport (wrapped around this one) reads it, and the client gets it."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def handle_async_request(self, request: Any) -> Any:
            version = request.extensions.get(_PV_EXT)
            response = await self.inner.handle_async_request(request)
            if version is not None:
                response.headers[POLICY_HEADER] = str(version)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    return StampTransport


UPSTREAM_CLIENTS = ("aiohttp", "httpx")


def _upstream_transport(kind: str) -> Any:
    """The bottom of the upstream client: aiohttp (C parser, the default) or httpx's own httpcore."""
    import httpx

    if kind == "aiohttp":
        try:
            from lightning_middleware._upstream import AiohttpTransport
        except ImportError:  # installed without the gateway extra: still works, at more CPU per call
            log.warning("aiohttp is not installed; the gateway talks to its upstreams through httpx")
        else:
            return AiohttpTransport(max_connections=256)
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))


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
        client_shards: int = 8,
        upstream_client: str = "aiohttp",
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
        if upstream_client not in UPSTREAM_CLIENTS:
            raise GatewayConfigError(f"upstream_client must be one of {UPSTREAM_CLIENTS}, got {upstream_client!r}")
        self.upstream_client = upstream_client
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
        self._shard = itertools.count()
        self._client: Any = None  # plain GETs (/v1/models)
        self._transports: list[Any] = []  # forwarded calls: capture -> stamp -> upstream connection
        self._timeout: dict[str, float] = {}
        self.client_shards = max(1, client_shards)
        self._health_client: Any = None
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
            self._app = _build_starlette(self)
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
        import httpx

        self._events()
        if self._client is None:
            # The chain each forwarded call goes through: capture (the same recording transport
            # wrap() installs), the policy-version stamp, then the upstream connection. Called
            # directly rather than through an httpx.AsyncClient: the client's per-request work
            # (URL merging, auth and redirect loops, cookies) bought the gateway nothing.
            # Several shards: with the httpx upstream client, httpcore's pool does work
            # proportional to (queued requests x connections), which dominated at 32 concurrent.
            # strip_added=False: gateway callers get the engine's token IDs and logprobs too.
            settings = CaptureSettings(store=self.store, record_unattached=self.record_unattached,
                                       strip_added=False)
            _, recording = transport_classes(httpx)
            stamp = _stamp_transport_class()
            shards = 1 if self.upstream_client == "aiohttp" else self.client_shards
            self._transports = [recording(stamp(_upstream_transport(self.upstream_client)), settings)
                                for _ in range(shards)]
            self._timeout = {"connect": self.connect_timeout_s, "read": self.upstream_timeout_s,
                             "write": self.upstream_timeout_s, "pool": self.upstream_timeout_s}
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.upstream_timeout_s,
                                                                   connect=self.connect_timeout_s))
            self._health_client = httpx.AsyncClient(timeout=self.health_timeout_s)
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(BaseException):
                await self._health_task
            self._health_task = None
        for c in [*self._transports, self._client, self._health_client]:
            if c is not None:
                await c.aclose()
        self._client = self._health_client = None
        self._transports = []
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
        if rollout_id:
            return _rendezvous(rollout_id, healthy)
        return healthy[next(self._rr) % len(healthy)]

    async def _check(self, u: Upstream) -> None:
        try:
            r = await self._health_client.get(u.url + "/health")
            ok, err = r.status_code == 200, None if r.status_code == 200 else f"health HTTP {r.status_code}"
        except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
            ok, err = False, f"{type(exc).__name__}: {exc}"
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
    async def proxy(self, request: Any, path: str, rollout_id: str | None) -> Any:
        from starlette.responses import Response

        header_rid = request.headers.get(ROLLOUT_HEADER)
        if header_rid and rollout_id and header_rid != rollout_id:
            raise _HTTPError(400, f"x-rollout-id {header_rid!r} disagrees with the URL's rollout {rollout_id!r}",
                             code="rollout_mismatch")
        rollout_id = rollout_id or header_rid or None
        raw = await _read_body(request, self.max_body_bytes)
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
        idem = request.headers.get("idempotency-key")
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
                return Response(cached.body, status_code=cached.status,
                                headers=_header_dict(cached.headers + [(REPLAY_HEADER, "1")]))

        ok_result: _Cached | None = None
        admitted = False
        try:
            version = await self._admit()
            admitted = True
            if entry is not None:
                entry.in_flight += 1
                entry.idle.clear()
            self.counters["calls"] += 1
            response = await self._send(request, path, raw, rollout_id, entry, version)
            status = response.status_code
            headers = _response_headers(response)
            if not stream or not 200 <= status < 300 or "text/event-stream" not in response.headers.get(
                    "content-type", ""):
                try:
                    body = await response.aread()
                except Exception as exc:
                    raise _upstream_exc(exc, response.extensions.get("lightning_upstream")) from None
                finally:
                    await response.aclose()
                if status >= 500:
                    self.counters["upstream_errors"] += 1
                    raise _HTTPError(502, f"upstream {response.extensions.get('lightning_upstream', '?')} answered "
                                     f"HTTP {status}: {body[:500].decode('utf-8', 'replace')}",
                                     type="upstream_error", code="upstream_error")
                if 200 <= status < 300:
                    ok_result = _Cached(status, headers, body)
                return Response(body, status_code=status, headers=_header_dict(headers))
            # A stream: take its first chunk before committing to 200, so a stalled upstream is a 504.
            # Decoded: content-encoding is not passed on (capture asks for identity, so usually raw).
            identity = response.headers.get("content-encoding", "identity").lower() in ("identity", "")
            chunks = response.aiter_raw() if identity else response.aiter_bytes()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except Exception as exc:
                await response.aclose()
                raise _upstream_exc(exc, response.extensions.get("lightning_upstream")) from None

            def on_done(complete: bool, sent: list[bytes]) -> None:
                if entry is not None:
                    _leave(entry)
                self._release()
                if flight is not None:
                    self._land(key, flight, _Cached(status, headers, b"".join(sent)) if complete else None)

            admitted = False  # the stream releases its slot when it ends
            return _StreamResponse(status, headers, first, chunks, response, on_done, keep=flight is not None)
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

    async def _send(self, request: Any, path: str, raw: bytes, rollout_id: str | None,
                    entry: _RolloutEntry | None, version: int | None) -> Any:
        import httpx

        if self._client is None:
            await self.startup()
        headers = [(k, v) for k, v in request.headers.items() if k not in _DROP_REQUEST_HEADERS]
        auth = self.upstream_api_key and f"Bearer {self.upstream_api_key}"
        if not auth and not self.token:
            auth = request.headers.get("authorization")  # a transparent proxy: the upstream's own key
        if auth:
            headers.append(("authorization", auth))
        tried: set[int] = set()
        transport = self._transports[next(self._shard) % len(self._transports)]
        token = _current.set(entry.state if entry is not None else None)
        try:
            while True:
                up = self._pick(rollout_id, tried)
                if up is None:
                    self.counters["upstream_errors"] += 1
                    raise _HTTPError(502, "no upstream reachable: " + "; ".join(
                        f"{u.url}: {u.last_error}" for u in self.upstreams if u.index in tried),
                        type="upstream_error", code="upstream_unreachable")
                tried.add(up.index)
                extensions: dict[str, Any] = {"timeout": self._timeout}
                if version is not None:
                    extensions[_PV_EXT] = version
                req = httpx.Request("POST", up.url + "/v1/" + path, content=raw, headers=headers,
                                    extensions=extensions)
                up.active += 1
                try:
                    response = await transport.handle_async_request(req)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    # Nothing reached this replica: mark it down and try another (the attempt is recorded).
                    up.healthy, up.last_error, up.last_check = False, f"{type(exc).__name__}: {exc}", time.time()
                    log.warning("upstream %s unreachable (%s); trying another", up.url, exc)
                    continue
                except Exception as exc:
                    raise _upstream_exc(exc, up.url) from None
                finally:
                    up.active -= 1
                response.extensions = {**response.extensions, "lightning_upstream": up.url}
                response.headers[UPSTREAM_HEADER] = str(up.index)
                return response
        finally:
            _current.reset(token)

    async def forward_get(self, request: Any, path: str) -> Any:
        from starlette.responses import Response

        if self._client is None:
            await self.startup()
        tried: set[int] = set()
        while True:
            up = self._pick(None, tried)
            if up is None:
                raise _HTTPError(502, "no upstream reachable", type="upstream_error", code="upstream_unreachable")
            tried.add(up.index)
            try:
                r = await self._client.get(up.url + "/v1/" + path, headers={
                    "authorization": f"Bearer {self.upstream_api_key}"} if self.upstream_api_key else None)
            except Exception as exc:  # noqa: BLE001
                up.healthy, up.last_error = False, f"{type(exc).__name__}: {exc}"
                continue
            return Response(r.content, status_code=r.status_code if r.status_code < 500 else 502,
                            headers=_header_dict(_response_headers(r)))


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
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return _HTTPError(504, f"upstream {where or '?'} timed out ({type(exc).__name__})", type="upstream_timeout",
                          code="upstream_timeout")
    return _HTTPError(502, f"upstream {where or '?'} failed: {type(exc).__name__}: {exc}", type="upstream_error",
                      code="upstream_error")


def _response_headers(response: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in response.headers.items() if k not in _DROP_RESPONSE_HEADERS]


def _header_dict(pairs: list[tuple[str, str]]) -> dict[str, str]:
    return dict(pairs)


async def _read_body(request: Any, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _HTTPError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
        except ValueError:
            raise _HTTPError(400, "bad Content-Length", code="bad_content_length") from None
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _HTTPError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        parts.append(chunk)
    return b"".join(parts)


class _StreamResponse:
    """An ASGI response that relays an upstream SSE stream chunk by chunk.

    Stops reading upstream when the client goes away (the recorder then marks the
    call partial), and reports (complete, bytes sent) exactly once when done.
    """

    def __init__(self, status: int, headers: list[tuple[str, str]], first: bytes, chunks: Any, upstream: Any,
                 on_done: Any, keep: bool) -> None:
        self.status, self.headers, self.first, self.chunks = status, headers, first, chunks
        self.upstream, self.on_done, self.keep = upstream, on_done, keep

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
            await send({"type": "http.response.start", "status": self.status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers]})
            if self.first:
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
                if self.keep:
                    sent.append(self.first)
            async for chunk in self.chunks:
                if gone.is_set():
                    break
                if self.keep:
                    sent.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:
                complete = not gone.is_set()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:  # upstream died mid-stream: the caller sees the stream end early
            log.warning("stream from upstream ended with %s: %s", type(exc).__name__, exc)
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await self.upstream.aclose()
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

def _build_starlette(gw: Gateway) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
    from sqlalchemy import exc as sa_exc

    def check_auth(request: Request) -> None:
        if not gw.token:
            return
        got = request.headers.get("authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), gw.token.encode()):
            raise _HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                             type="authentication_error", code="unauthorized",
                             headers={"WWW-Authenticate": "Bearer"})

    def endpoint(fn: Any, *, auth: bool = True) -> Any:
        async def handler(request: Request) -> Any:
            try:
                if auth:
                    check_auth(request)
                return await fn(request)
            except _HTTPError as err:
                return Response(err.body(), status_code=err.status, media_type="application/json",
                                headers=err.headers)
            except (StoreError, sa_exc.SQLAlchemyError) as exc:
                log.warning("trace store error on %s %s: %s", request.method, request.url.path, exc)
                err = _HTTPError(503, "the trace store is unavailable; retry later", type="store_unavailable",
                                 code="store_unavailable", headers={"Retry-After": "5"})
                return Response(err.body(), status_code=503, media_type="application/json", headers=err.headers)
            except Exception as exc:  # noqa: BLE001
                log.exception("gateway error on %s %s", request.method, request.url.path)
                err = _HTTPError(500, f"gateway error: {type(exc).__name__}", type="server_error")
                return Response(err.body(), status_code=500, media_type="application/json")
        return handler

    async def json_body(request: Request, *, optional: bool = False) -> dict[str, Any]:
        raw = await _read_body(request, gw.max_body_bytes)
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

    async def chat(request: Request) -> Any:
        return await gw.proxy(request, "chat/completions", request.path_params.get("rid"))

    async def completions(request: Request) -> Any:
        return await gw.proxy(request, "completions", request.path_params.get("rid"))

    async def models(request: Request) -> Any:
        rid = request.path_params.get("rid")
        if rid:
            await gw._entry(rid, for_call=False)
        return await gw.forward_get(request, "models")

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
        return Response(err.body(), status_code=404, media_type="application/json")

    async def bad_method(request: Request, _exc: Exception) -> Any:
        err = _HTTPError(405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        return Response(err.body(), status_code=405, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    routes = [
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/rollouts", endpoint(create), methods=["POST"]),
        Route("/rollouts/{rid}", endpoint(get_rollout), methods=["GET"]),
        Route("/rollouts/{rid}/reward", endpoint(reward), methods=["POST"]),
        Route("/rollouts/{rid}/finish", endpoint(finish), methods=["POST"]),
        Route("/rollouts/{rid}/fail", endpoint(fail), methods=["POST"]),
        Route("/rollouts/{rid}/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/rollouts/{rid}/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/rollouts/{rid}/v1/models", endpoint(models), methods=["GET"]),
        Route("/admin/pause", endpoint(pause), methods=["POST"]),
        Route("/admin/resume", endpoint(resume), methods=["POST"]),
        Route("/admin/state", endpoint(state), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.state.gateway = gw
    return app


def build_app(upstreams: list[str] | str, store: TraceStore | str | None = None, **options: Any) -> Any:
    """The gateway as an ASGI app (serve it with any ASGI server); `app.state.gateway` is the `Gateway`."""
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
    p.add_argument("--upstream-client", choices=UPSTREAM_CLIENTS, default="aiohttp",
                   help="HTTP client to the upstreams (default aiohttp: its C parser costs less CPU per call)")
    p.add_argument("--no-record-unattached", action="store_true", help="don't record calls outside rollouts")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    import uvicorn

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.verbose:  # httpx logs every upstream request at INFO: noise, and a cost per call
        for name in ("httpx", "httpcore", "aiohttp"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        gw = Gateway(args.upstream, args.store, host=args.host, port=args.port, token=token,
                     upstream_api_key=args.upstream_api_key or os.environ.get("LIGHTNING_UPSTREAM_API_KEY"),
                     max_body_bytes=int(args.max_body_mb * 1024 * 1024), pause_mode=args.pause_mode,
                     pause_wait_s=args.pause_wait, upstream_timeout_s=args.upstream_timeout,
                     health_interval_s=args.health_interval, retry_window_s=args.retry_window,
                     policy_version=args.policy_version, record_unattached=not args.no_record_unattached,
                     upstream_client=args.upstream_client)
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
