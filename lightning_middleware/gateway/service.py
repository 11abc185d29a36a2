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
- `POST /v1/responses`, `POST /v1/messages` (the Responses API, Anthropic Messages): sent
  upstream as chat completions and answered in the caller's format (`translation`,
  docs/formats.md), or as they are with `translate=False`.
- `POST /rollouts` (idempotent on a client-supplied `id`), `GET /rollouts/{id}`,
  `POST /rollouts/{id}/reward`, `POST /rollouts/{id}/finish`, `POST /rollouts/{id}/fail`.
- `POST /admin/pause`, `POST /admin/resume`, `GET /admin/state` (weight swaps),
  `GET /health` (no auth). Without a token: loopback clients only (`auth.check_client`).

Training safety: an `Idempotency-Key` request header replays the stored response
(one upstream call, one training call; after a restart, or at another replica on the same store,
from the call's record, which keeps the key), and identical bodies resent within a
rollout while the first is in flight or within `retry_window_s` after it
succeeded are answered from the first (a client's retry storm stays one call). A reward POST
with an `Idempotency-Key` is stored once (`reward_keys`); a rollout may carry its own
agent -> policy map (`rollout_policies`).

The parts, one module each: `admission` (the pause gate), `upstreams` (replica choice and
health), `replay` (retries answered from the first call), `rollouts` (rollouts over HTTP),
`rollout_policies`, `reward_keys`, `client` (`GatewayClient`),
`requests` (raw ASGI requests), `translation` (other formats as chat completions), `app` (routes),
`cli`; the HTTP layer it shares with the review page is `lightning_middleware.asgi`. Heavy imports
(starlette, uvicorn, aiohttp) happen inside functions: registering the CLI stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from lightning_middleware import fastjson
from lightning_middleware.asgi.auth import (
    TOKEN_ENV,
    check_bearer,
    check_client,
    checked_token,
    is_loopback,
    scoped_rollout,
)
from lightning_middleware.asgi.error_replies import GatewayConfigError, HTTPError, error_reply, upstream_error
from lightning_middleware.asgi.replies import Full, Scope, Send, StreamResponse, bind_socket
from lightning_middleware.capture import ROLLOUT_HEADER, scrub_secrets
from lightning_middleware.formats import FORMATS, Format
from lightning_middleware.gateway.admission import PAUSE_MODES, PauseGate
from lightning_middleware.gateway.app import GatewayApp
from lightning_middleware.gateway.forwarding import POLICY_HEADER, Forwarder, Upstreamed
from lightning_middleware.gateway.replay import Cached, Flight, ReplayCache, answer_from_record, is_retry
from lightning_middleware.gateway.requests import Receive, parse_object, receive_body
from lightning_middleware.gateway.reward_keys import RewardKeys, check_key
from lightning_middleware.gateway.rollouts import RolloutEntry, RolloutRegistry
from lightning_middleware.gateway.translation import TranslatedCall, in_format, translate_call
from lightning_middleware.gateway.upstreams import Upstream, UpstreamPool
from lightning_middleware.records import SANDBOX_BREACH, Event, new_id
from lightning_middleware.rewards import RewardConfig, Scorer, load_config
from lightning_middleware.store import TraceStore, get_store

log = logging.getLogger(__name__)

REPLAY_HEADER = "x-lightning-replayed"
# uvicorn closes an idle connection after 5 s by default, the very moment httpx's pool (expiry 5 s)
# may reuse it: the request then dies as a ReadError before the gateway reads it, so it is never
# recorded. Idle connections stay open longer than clients keep them (nginx's default, 75 s).
KEEP_ALIVE_S = 75


class Gateway:
    """The gateway's state and ASGI app; `start()` serves it on uvicorn in a background thread.

    `pause()`, `resume()` and `state()` are thread-safe (the weight publisher calls
    them from its own thread); `apause()` & co. are their coroutine forms.
    """

    def __init__(
        self,
        upstreams: Sequence[str] | str,
        store: TraceStore | str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        upstream_api_key: str | None = None,
        max_body_bytes: int = 16 * 1024 * 1024,
        max_header_bytes: int = 64 * 1024,
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
        keep_alive_s: int = KEEP_ALIVE_S,
        record_unattached: bool = True,
        policy_version: int | None = None,
        translate: bool = True,
        policies: Mapping[str, str] | None = None,
        default_policy: str | None = None,
        rewards: RewardConfig | Scorer | str | None = None,
        exact_history: bool = False,
    ) -> None:
        """`rewards`: a reward configuration (or its TOML/JSON file) every rollout is scored under
        as it finishes (docs/rewards.md). `exact_history`: a rollout's earlier tool-calling turns
        go to the engine as the text the model sampled (`wrap(exact_history=)`, capture/exact_history.py)."""
        if isinstance(upstreams, str):
            upstreams = [upstreams]
        if not upstreams:
            raise GatewayConfigError("at least one --upstream URL is needed")
        if pause_mode not in PAUSE_MODES:
            raise GatewayConfigError(f"pause_mode must be 'wait' or 'reject', got {pause_mode!r}")
        token = checked_token(token)
        if not is_loopback(host) and not token:
            raise GatewayConfigError(
                f"refusing to listen on {host} without a bearer token: pass --token (or set {TOKEN_ENV}), "
                "or bind 127.0.0.1")
        if max_body_bytes <= 0 or max_header_bytes <= 0:
            raise GatewayConfigError("max_body_bytes and max_header_bytes must be positive")
        self.pool = UpstreamPool(upstreams, health_timeout_s=health_timeout_s)
        self.store = get_store(store)
        self.host, self.port, self.token = host, port, token
        self._breaches: set[tuple[str, str]] = set()  # (rollout, class) already recorded
        self.upstream_api_key = upstream_api_key
        self.max_body_bytes, self.max_header_bytes = max_body_bytes, max_header_bytes
        self.keep_alive_s = keep_alive_s
        self.connect_timeout_s, self.upstream_timeout_s = connect_timeout_s, upstream_timeout_s
        self.health_interval_s = health_interval_s
        self.record_unattached = record_unattached
        # /v1/responses and /v1/messages: sent as chat completions (True), or as they are (False,
        # for replicas that speak those formats; recorded without token IDs).
        self.translate = translate
        self.gate = PauseGate(mode=pause_mode, wait_s=pause_wait_s, retry_after_s=retry_after_s)
        self.replay = ReplayCache(retry_window_s=retry_window_s, idempotency_ttl_s=idempotency_ttl_s,
                                  max_entries=max_cached_responses,
                                  max_wait_s=upstream_timeout_s + pause_wait_s + 30)
        scorer = rewards if isinstance(rewards, Scorer) or rewards is None else Scorer(
            rewards if isinstance(rewards, RewardConfig) else load_config(rewards))
        self.rollouts = RolloutRegistry(self.store, finish_wait_s=upstream_timeout_s, scorer=scorer)
        self.reward_keys = RewardKeys(self.rollouts, ttl_s=idempotency_ttl_s)
        if policy_version is None:  # continue from the newest checkpoint the trainer recorded
            try:
                policy_version = self.store.latest_policy_version()
            except Exception:  # noqa: BLE001 - a fresh store, or one that is down: start unversioned
                policy_version = None
        self.policy_version = policy_version
        self.forwarder = Forwarder(self.pool, self.store, upstream_api_key=upstream_api_key, token=token,
                                   connect_timeout_s=connect_timeout_s, upstream_timeout_s=upstream_timeout_s,
                                   record_unattached=record_unattached, policies=dict(policies or {}),
                                   default_policy=default_policy, exact_history=exact_history)
        self.calls = 0
        self._health_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app: GatewayApp | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------
    @property
    def upstreams(self) -> list[Upstream]:
        return self.pool.upstreams

    @property
    def app(self) -> GatewayApp:
        """The ASGI app (built on first use)."""
        if self._app is None:
            self._app = GatewayApp(self)
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

    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.forwarder.open()
        session = self.forwarder.session
        assert session is not None
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self.pool.health_loop(session, self.health_interval_s))

    async def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(BaseException):
                await self._health_task
            self._health_task = None
        await self.forwarder.close()
        await asyncio.to_thread(self.store.flush, 10.0)

    def start(self, timeout: float = 30.0) -> Gateway:
        """Serve on uvicorn in a daemon thread; returns once it accepts connections."""
        import uvicorn

        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5, timeout_keep_alive=self.keep_alive_s)
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

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- admin (coroutines, on the gateway's loop) ---------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            **self.gate.snapshot(), "policy_version": self.policy_version,
            "open_rollouts": self.rollouts.open_count(), "upstreams": [u.as_dict() for u in self.pool],
            "counters": {"calls": self.calls, "replayed": self.replay.replayed, "rejected_paused": self.gate.rejected,
                         "upstream_errors": self.forwarder.upstream_errors},
        }

    async def apause(self, *, wait: bool = True, timeout: float = 60.0, mode: str | None = None) -> dict[str, Any]:
        """Stop admitting calls; with `wait`, return once in-flight calls have finished (or `timeout`)."""
        drained = await self.gate.pause(wait=wait, timeout=timeout, mode=mode)
        return {**self.snapshot(), "drained": drained}

    async def aresume(self, *, policy_version: int | None = None) -> dict[str, Any]:
        """Admit calls again; with `policy_version`, calls from here on are stamped with it."""
        if policy_version is not None:
            self.policy_version = policy_version
        self.gate.resume()
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

    async def check_health(self) -> None:
        await self.forwarder.open()
        session = self.forwarder.session
        assert session is not None
        await self.pool.check_health(session)

    # -- the proxied call -----------------------------------------------------
    async def serve_proxy(self, scope: Scope, receive: Receive, send: Send, path: str,
                          rollout_id: str | None) -> None:
        """Serve one POST to a proxy route (`path`: "chat/completions", "completions", "responses", "messages")."""
        pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        try:
            headers = dict(pairs)
            self.check_auth(headers.get("authorization", ""), scope.get("client"), rollout_id=rollout_id,
                            route=f"POST {scope['path']}")
            reply = await self.proxy(pairs, headers, receive, path, rollout_id)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
            reply = error_reply(exc, "POST", scope["path"])
            fmt = FORMATS.get(path)
            if fmt is not None:  # in the caller's error format
                reply = in_format(fmt, reply)
        await reply(scope, receive, send)

    def format_of(self, path: str) -> Format | None:
        """The format a proxy path's requests are translated from, or None (sent as they are)."""
        return FORMATS.get(path) if self.translate else None

    def check_auth(self, authorization: str, client: Sequence[Any] | None = None, *,
                   rollout_id: str | None = None, route: str = "") -> str | None:
        """The token, when there is one; without one, the client must be on loopback.

        A rollout-scoped token (asgi/auth.py) passes only on a route of the rollout it names, where
        the caller passes that route's `rollout_id` (the routes a confined rollout may use); it
        returns that id (None for the gateway's own token). Anywhere else it is a 403 and the
        rollout's `sandbox_network` breach."""
        scoped = scoped_rollout(self.token, authorization)
        if scoped is not None:
            if scoped != rollout_id:
                self.record_breach(scoped, "sandbox_network", f"{route} with its rollout token")
                raise HTTPError(403, f"a rollout's token opens only its own routes (/rollouts/{scoped}/v1/..., "
                                     f"GET /rollouts/{scoped}, POST /rollouts/{scoped}/reward)",
                                type="permission_error", code="rollout_scope")
            return scoped
        check_bearer(self.token, authorization)
        check_client(self.token, client)
        return None

    def record_breach(self, rollout_id: str, kind: str, what: str) -> None:
        """A `sandbox_breach` event, once per rollout and class (a rollout that keeps trying does not
        flood the store), written before the refusal is sent: the rollout's backend reads it when
        the rollout ends."""
        if (rollout_id, kind) in self._breaches:
            return
        if len(self._breaches) >= 100_000:
            self._breaches.clear()
        self._breaches.add((rollout_id, kind))
        try:
            self.store.add_event(Event(kind=SANDBOX_BREACH, source="gateway", message=f"{kind}: {what}"[:500],
                                       data={"rollout_id": rollout_id, "class": kind}))
        except Exception as exc:  # noqa: BLE001 - the refusal stands; only its record is lost
            log.warning("could not record rollout %s's breach (%s): %s", rollout_id, kind, exc)

    async def proxy(self, pairs: list[tuple[str, str]], headers: dict[str, str], receive: Receive, path: str,
                    rollout_id: str | None) -> Full | StreamResponse:
        """Admit, deduplicate, record and forward one call. Returns the ASGI response to send;
        raises `HTTPError` while nothing has been sent yet."""
        header_rid = headers.get(ROLLOUT_HEADER)
        if header_rid and rollout_id and header_rid != rollout_id:
            raise HTTPError(400, f"x-rollout-id {header_rid!r} disagrees with the URL's rollout {rollout_id!r}",
                             code="rollout_mismatch")
        rollout_id = rollout_id or header_rid or None
        raw = await receive_body(receive, headers, self.max_body_bytes)
        payload = parse_object(raw)
        payload, scrubbed = scrub_secrets(payload)
        if scrubbed:
            raw = fastjson.dumps(payload).encode()
        entry = await self.rollouts.entry(rollout_id, for_call=True) if rollout_id else None
        fmt = self.format_of(path)
        translated = await translate_call(fmt, payload, self.store) if fmt is not None else None
        stream = bool(payload.get("stream"))
        body_hash = hashlib.sha256(raw).hexdigest()

        key, ttl = self.replay.key_for(headers, rollout_id, path, body_hash)
        flight: Flight | None = None
        if key is not None:
            claimed = await self.replay.claim(key, ttl, body_hash, replay=key[0] == "idem" or is_retry(headers))
            if isinstance(claimed, Cached):
                return Full(claimed.status, claimed.headers + [(REPLAY_HEADER.encode(), b"1")], claimed.body)
            flight = claimed
            if key[0] == "idem":  # not in memory: a record the store keeps under this key answers it
                try:
                    kept = await self._recorded_answer(key[2], rollout_id, raw, translated, stream)
                except BaseException:
                    self.replay.land(key, flight, None)
                    raise
                if kept is not None:
                    self.replay.land(key, flight, kept)
                    return Full(kept.status, kept.headers + [(REPLAY_HEADER.encode(), b"1")], kept.body)

        ok_result: Cached | None = None
        admitted = False
        try:
            await self.gate.admit()
            version = self.policy_version
            admitted = True
            if entry is not None:
                entry.enter()
            self.calls += 1
            call = await self._forward(pairs, headers, path, raw, payload, rollout_id, entry, version, translated)
            call_id = call.pending.call_id if call.pending is not None else new_id()
            status = call.response.status
            if not stream or not 200 <= status < 300 or "text/event-stream" not in call.content_type:
                try:
                    body = await call.response.read()
                except Exception as exc:
                    call.record([], error=exc)
                    raise upstream_error(exc, call.where) from None
                finally:
                    call.response.release()
                call.record([body])
                if status >= 500:
                    self.forwarder.upstream_errors += 1
                    raise HTTPError(502, f"upstream {call.where} answered HTTP {status}: "
                                     f"{body[:500].decode('utf-8', 'replace')}",
                                     type="upstream_error", code="upstream_error")
                if translated is not None:
                    body = translated.answer(status, body, call_id)
                if 200 <= status < 300:
                    ok_result = Cached(status, call.headers, body)
                return Full(status, call.headers, body)
            # A stream: take its first chunk before committing to 200, so a stalled upstream is a 504.
            chunks: AsyncIterator[bytes] = call.response.content.iter_any()
            upstream_chunks: list[bytes] | None = None  # a translated stream's own chunks (what is recorded)
            if translated is not None:
                upstream_chunks = []
                chunks = translated.stream(chunks, upstream_chunks, call_id)
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except Exception as exc:
                call.response.close()
                call.record([], error=exc)
                raise upstream_error(exc, call.where) from None

            def on_done(complete: bool, sent: list[bytes]) -> None:
                call.record(sent if upstream_chunks is None else upstream_chunks)  # incomplete: a partial call
                if entry is not None:
                    entry.leave()
                self.gate.release()
                if flight is not None and key is not None:
                    self.replay.land(key, flight, Cached(status, call.headers, b"".join(sent)) if complete else None)

            admitted = False  # the stream releases its slot when it ends
            return StreamResponse(status, call.headers, first, chunks, call.response, on_done)
        except BaseException:
            if flight is not None and key is not None:
                self.replay.land(key, flight, None)
                flight = None
            raise
        finally:
            if admitted:
                if entry is not None:
                    entry.leave()
                self.gate.release()
                if flight is not None and key is not None:
                    self.replay.land(key, flight, ok_result)


    async def _recorded_answer(self, idem: str, rollout_id: str | None, raw: bytes,
                               translated: TranslatedCall | None, stream: bool) -> Cached | None:
        """The answer to a call the store holds under this Idempotency-Key (sent to an earlier
        gateway process, or to another replica on this store), or None: send it upstream."""
        check_key(idem)
        try:
            found = await asyncio.to_thread(self.store.keyed_call, rollout_id, idem)
        except Exception as exc:  # noqa: BLE001 - a store that is down must not fail the call
            log.warning("could not look up Idempotency-Key %r in the store (%s); sending the call upstream",
                        idem, exc)
            return None
        if found is None:
            return None
        sent = translated.body if translated is not None else raw
        if found.request_hash != hashlib.sha256(sent).hexdigest():
            raise HTTPError(409, "Idempotency-Key reused with a different request body", code="idempotency_conflict")
        headers, body = answer_from_record(found, stream=stream)
        if translated is not None:
            body = translated.events(body, found.id) if stream else translated.answer(200, body, found.id)
        if found.policy_version is not None:
            headers = [*headers, (POLICY_HEADER.encode(), str(found.policy_version).encode())]
        return Cached(found.status_code or 200, headers, body)

    async def _forward(self, pairs: list[tuple[str, str]], headers: dict[str, str], path: str, raw: bytes,
                       payload: dict[str, Any], rollout_id: str | None, entry: RolloutEntry | None,
                       version: int | None, translated: TranslatedCall | None) -> Upstreamed:
        """Forward the call as it came, or translated to chat completions."""
        state = entry.state if entry is not None else None
        if translated is None:
            return await self.forwarder.forward(pairs, headers, path, raw, payload, rollout_id, state, version)
        return await self.forwarder.forward(pairs, headers, "chat/completions", translated.body, translated.chat,
                                            rollout_id, state, version, source=translated.source)


def build_app(upstreams: Sequence[str] | str, store: TraceStore | str | None = None, **options: Any) -> GatewayApp:
    """The gateway as an ASGI app (serve it with any ASGI server); `app.gateway` (also `app.state.gateway`)
    is the `Gateway`."""
    app: GatewayApp = Gateway(upstreams, store, **options).app
    return app
