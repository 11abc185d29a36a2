"""Sending a recorded call to a replica: headers passed on or replaced, token IDs injected by
capture, the next replica tried when one cannot be reached, and every attempt recorded."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning_middleware.asgi.error_replies import HTTPError, failure_name, unreachable, upstream_error
from lightning_middleware.asgi.replies import Full, Headers, reply_headers
from lightning_middleware.capture import (
    AGENT_HEADER,
    ROLLOUT_HEADER,
    CaptureSettings,
    RolloutState,
    Source,
    attempt_of,
    begin_call,
)
from lightning_middleware.gateway.upstreams import UpstreamPool
from lightning_middleware.store import TraceStore

if TYPE_CHECKING:  # aiohttp is imported when the gateway starts
    import aiohttp

    from lightning_middleware.capture.calls import PendingCall

log = logging.getLogger(__name__)

POLICY_HEADER = "x-lightning-policy-version"
UPSTREAM_HEADER = "x-lightning-upstream"

# Never sent upstream as the client sent them (Authorization is replaced per policy).
DROP_REQUEST_HEADERS = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
    "proxy-authorization", "proxy-connection", "authorization", "cookie", "x-api-key", "api-key",
    "idempotency-key", ROLLOUT_HEADER, AGENT_HEADER, "accept-encoding", "expect",
})
# The record's endpoint for each upstream path (responses / messages: sent untranslated).
ENDPOINTS = {"chat/completions": "chat.completions", "completions": "completions", "responses": "responses",
             "messages": "anthropic.messages"}


class Forwarder:
    """One aiohttp session for every upstream request (opened on the gateway's loop)."""

    def __init__(self, pool: UpstreamPool, store: TraceStore, *, upstream_api_key: str | None, token: str | None,
                 connect_timeout_s: float, upstream_timeout_s: float, record_unattached: bool,
                 policies: dict[str, str] | None = None, default_policy: str | None = None,
                 exact_history: bool = False) -> None:
        """`policies`: agent name (the `x-agent-name` header) -> its policy's served model name."""
        self.pool, self.store = pool, store
        self.upstream_api_key, self.token = upstream_api_key, token
        self.connect_timeout_s, self.upstream_timeout_s = connect_timeout_s, upstream_timeout_s
        self.record_unattached = record_unattached
        self.policies, self.default_policy = policies or {}, default_policy
        self.exact_history = exact_history
        self.upstream_errors = 0
        self.session: aiohttp.ClientSession | None = None
        self.call_timeout: aiohttp.ClientTimeout | None = None
        self.capture: CaptureSettings | None = None

    async def open(self) -> None:
        import aiohttp

        if self.session is not None:
            return
        # aiohttp: its C HTTP parser and cheap pool cost a fraction of httpx/httpcore's
        # pure-Python h11 per call. Bodies arrive decoded, so capture sees plain bytes.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=0),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar())
        self.call_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                                  sock_read=self.upstream_timeout_s)
        # strip_added=False: gateway callers get the engine's token IDs and logprobs too.
        self.capture = CaptureSettings(store=self.store, record_unattached=self.record_unattached, strip_added=False,
                                       policies=self.policies, default_policy=self.default_policy,
                                       exact_history=self.exact_history)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def forward(self, pairs: list[tuple[str, str]], headers: dict[str, str], path: str, raw: bytes,
                      payload: dict[str, Any], rollout_id: str | None, state: RolloutState | None,
                      version: int | None, source: Source | None = None) -> Upstreamed:
        """Record and send the call to a replica (sticky per rollout; the next one if it can't be reached)."""
        if self.session is None:
            await self.open()
        session = self.session
        assert session is not None
        out = [(k, v) for k, v in pairs if k not in DROP_REQUEST_HEADERS]
        out.append(("accept-encoding", "identity"))  # plain bytes for capture, no compression on loopback
        auth = self.upstream_api_key and f"Bearer {self.upstream_api_key}"
        if not auth and not self.token:
            auth = headers.get("authorization")  # a transparent proxy: the upstream's own key
        if auth:
            out.append(("authorization", auth))
        endpoint = ENDPOINTS[path]
        tried: set[int] = set()
        while True:
            up = self.pool.pick(rollout_id, tried)
            if up is None:
                self.upstream_errors += 1
                raise HTTPError(502, "no upstream reachable: " + "; ".join(
                    f"{u.url}: {u.last_error}" for u in self.pool if u.index in tried),
                    type="upstream_error", code="upstream_unreachable")
            tried.add(up.index)
            try:  # every attempt is recorded; recording never fails the call
                pending, new_body = begin_call(self.capture, endpoint, payload, raw, state, up.host,  # type: ignore[arg-type]
                                               agent_name=headers.get(AGENT_HEADER), attempt=attempt_of(headers),
                                               source=source, idempotency_key=headers.get("idempotency-key"))
            except Exception:
                log.exception("capture failed before sending; forwarding unrecorded")
                pending, new_body = None, None
            url = up.endpoint(path)
            up.active += 1
            try:
                response = await session.post(url, data=raw if new_body is None else new_body, headers=out,
                                                    allow_redirects=False, timeout=self.call_timeout)
                if pending is not None and pending.rejected(response.status, up.host):
                    response.release()  # resend as the caller wrote it
                    response = await session.post(url, data=raw, headers=out, allow_redirects=False,
                                                        timeout=self.call_timeout)
                    pending.resent(response.status, up.host)
            except BaseException as exc:  # CancelledError too: the attempt is recorded as failed
                if pending is not None:
                    pending.finish(error=f"{failure_name(exc)}: {exc}")
                if isinstance(exc, Exception) and unreachable(exc):
                    # Nothing reached this replica: mark it down and try another.
                    up.mark_down(f"{failure_name(exc)}: {exc}")
                    log.warning("upstream %s unreachable (%s); trying another", up.url, exc)
                    continue
                if isinstance(exc, Exception):
                    raise upstream_error(exc, up.url) from None
                raise
            finally:
                up.active -= 1
            answer_headers = reply_headers(response.raw_headers)
            if version is not None:
                answer_headers.append((POLICY_HEADER.encode(), str(version).encode()))
            answer_headers.append((UPSTREAM_HEADER.encode(), str(up.index).encode()))
            return Upstreamed(response, answer_headers, pending, up.url, version)

    async def get(self, path: str) -> Full:
        """GET `/v1/{path}` from a replica (e.g. models), unrecorded."""
        if self.session is None:
            await self.open()
        session = self.session
        assert session is not None
        headers = {"authorization": f"Bearer {self.upstream_api_key}"} if self.upstream_api_key else None
        tried: set[int] = set()
        while True:
            up = self.pool.pick(None, tried)
            if up is None:
                raise HTTPError(502, "no upstream reachable", type="upstream_error", code="upstream_unreachable")
            tried.add(up.index)
            try:
                async with session.get(up.url + "/v1/" + path, headers=headers,
                                             timeout=self.call_timeout) as r:
                    body = await r.read()
                    status = r.status
                    answer_headers = reply_headers(r.raw_headers)
            except Exception as exc:  # noqa: BLE001
                up.mark_down(f"{failure_name(exc)}: {exc}")
                continue
            return Full(status if status < 500 else 502, answer_headers, body)


class Upstreamed:
    """An upstream's answer to one recorded attempt, before its body is read."""

    __slots__ = ("response", "headers", "pending", "where", "version", "content_type")

    def __init__(self, response: aiohttp.ClientResponse, headers: Headers, pending: PendingCall | None, where: str,
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
                            headers=meta, error=None if error is None else f"{failure_name(error)}: {error}")
