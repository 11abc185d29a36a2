"""A client for the gateway's rollout routes, for harnesses that drive agents in another process
(or language) through the gateway:

    gw = GatewayClient("http://gw:8090", token=os.environ.get("LIGHTNING_GATEWAY_TOKEN"))
    r = gw.create_rollout("job42", policies={"coder": "coder", "reviewer": "reviewer"})
    ...                                   # the agent's OpenAI base URL: r["base_url"]
    gw.reward(r["id"], 1.0, agent="reviewer")
    gw.finish(r["id"], reward=1.0)

Every request is retried on a connection error, a timeout, and a 429/502/503/504 answer (the
store restarting answers 503 + Retry-After), and every retry is safe: a rollout is created under
an id chosen here before the first attempt, a finish is idempotent, and a reward is sent with
one `Idempotency-Key` per logical reward, reused on its retries, so a reward whose answer was
lost is stored once (docs/gateway.md, "Rewards sent once").
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import httpx

from lightning_middleware.asgi.auth import TOKEN_ENV

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class GatewayClientError(RuntimeError):
    """The gateway refused a rollout request (or kept failing it); the message has its answer."""


class GatewayClient:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0, attempts: int = 5,
                 backoff_s: float = 0.2, transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.attempts, self.backoff_s = max(1, attempts), backoff_s
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), transport=transport)

    @classmethod
    def from_env(cls, url: str, **kwargs: Any) -> GatewayClient:
        """With the token from $LIGHTNING_GATEWAY_TOKEN (the variable the gateway itself reads)."""
        import os

        return cls(url, token=os.environ.get(TOKEN_ENV) or None, **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def create_rollout(self, task_id: str, *, rollout_id: str | None = None, input: Any = None,
                       mode: str = "train", metadata: Mapping[str, Any] | None = None,
                       policies: Mapping[str, str] | None = None,
                       default_policy: str | None = None) -> dict[str, Any]:
        """Open a rollout; `policies` (agent name -> served model name) and `default_policy` route
        its calls by the `x-agent-name` header, before the gateway-wide map (docs/policies.md)."""
        body: dict[str, Any] = {"id": rollout_id or uuid.uuid4().hex, "task_id": task_id, "mode": mode}
        for name, value in (("input", input), ("metadata", metadata), ("default_policy", default_policy)):
            if value is not None:
                body[name] = value
        if policies:
            body["policies"] = dict(policies)
        return self._post("/rollouts", body)

    def reward(self, rollout_id: str, value: float, *, name: str | None = None, final: bool | None = None,
               agent: str | None = None, call_index: int | None = None,
               metadata: Mapping[str, Any] | None = None, key: str | None = None) -> dict[str, Any]:
        """Store one reward, once however many attempts it takes (`key`: the Idempotency-Key;
        by default a new one per call of this method). `final` unset: the gateway's rule (final,
        unless it is a per-step reward with a `call_index`)."""
        body: dict[str, Any] = {"value": value}
        for field, given in (("name", name), ("final", final), ("agent", agent), ("call_index", call_index),
                             ("metadata", metadata)):
            if given is not None:
                body[field] = given
        return self._post(f"/rollouts/{rollout_id}/reward", body, headers={"idempotency-key": key or uuid.uuid4().hex})

    def finish(self, rollout_id: str, *, status: str = "succeeded", reward: float | None = None,
               error: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"status": status}
        if reward is not None:
            body["reward"] = reward
        if error is not None:
            body["error"] = error
        return self._post(f"/rollouts/{rollout_id}/finish", body)

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return self._send("GET", f"/rollouts/{rollout_id}", None, {})

    def _post(self, path: str, body: dict[str, Any], *, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self._send("POST", path, body, dict(headers or {}))

    def _send(self, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]) -> dict[str, Any]:
        """One logical request: the same request sent again until it is answered or out of attempts."""
        for attempt in range(self.attempts):
            last = attempt == self.attempts - 1
            try:
                resp = self._http.request(method, self.url + path, json=body, headers=headers)
            except httpx.TransportError as exc:  # lost on the way there or back: resent, safely
                if last:
                    raise GatewayClientError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
                log.warning("%s %s failed (%s: %s); retrying", method, path, type(exc).__name__, exc)
                self._wait(attempt, None)
                continue
            if resp.status_code in RETRY_STATUSES and not last:
                log.warning("%s %s answered %d; retrying", method, path, resp.status_code)
                self._wait(attempt, resp.headers.get("retry-after"))
                continue
            if resp.status_code >= 400:
                raise GatewayClientError(f"{method} {path} -> {resp.status_code}: {resp.text[:500]}")
            out: dict[str, Any] = resp.json()
            return out
        raise AssertionError("unreachable")

    def _wait(self, attempt: int, retry_after: str | None) -> None:
        delay = self.backoff_s * 2**attempt
        try:
            delay = min(float(retry_after), 30.0) if retry_after else delay
        except ValueError:
            pass
        time.sleep(delay)
