"""A client for the gateway's admin API, the one contract the weight publisher and operators use:

    admin = GatewayAdmin("http://gw:8090", token=os.environ.get("LIGHTNING_GATEWAY_TOKEN"))
    admin.pause()                      # new calls wait; returns once in-flight calls finished
    admin.resume(policy_version=12)    # calls from here on are served (and stamped) as version 12
    admin.state()

`POST /admin/pause` takes `{"wait": bool, "timeout": seconds, "mode": "wait"|"reject"}`,
`POST /admin/resume` takes `{"policy_version": int}` (omitted: the version stays), both answer
the gateway's state; every admin route needs `Authorization: Bearer <token>` when the gateway
has a token.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from lightning_middleware.asgi.auth import TOKEN_ENV


class GatewayAdminError(RuntimeError):
    """The gateway refused or failed an admin request; the message has its answer."""


class GatewayAdmin:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._transport = transport

    @classmethod
    def from_env(cls, url: str, **kwargs: Any) -> GatewayAdmin:
        """With the token from $LIGHTNING_GATEWAY_TOKEN (the variable the gateway itself reads)."""
        import os

        return cls(url, token=os.environ.get(TOKEN_ENV) or None, **kwargs)

    def pause(self, *, wait: bool = True, timeout: float = 60.0, mode: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"wait": wait, "timeout": timeout}
        if mode is not None:
            body["mode"] = mode
        return self._post("/admin/pause", body, read_timeout=timeout + 10)

    def resume(self, *, policy_version: int | None = None, attempts: int = 3) -> dict[str, Any]:
        """Resume (retried on connection errors: a gateway left paused holds every call)."""
        body = {} if policy_version is None else {"policy_version": int(policy_version)}
        for i in range(attempts):
            try:
                return self._post("/admin/resume", body)
            except httpx.TransportError:
                if i == attempts - 1:
                    raise
                time.sleep(0.1)
        raise AssertionError("unreachable")

    def state(self) -> dict[str, Any]:
        with self._client() as c:
            return self._json(c.get(self.url + "/admin/state"))

    def _post(self, path: str, body: dict[str, Any], read_timeout: float | None = None) -> dict[str, Any]:
        with self._client(read_timeout) as c:
            return self._json(c.post(self.url + path, json=body))

    def _client(self, read_timeout: float | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        timeout = httpx.Timeout(max(self.timeout, read_timeout or 0.0), connect=10.0)
        return httpx.Client(headers=headers, timeout=timeout, transport=self._transport)

    @staticmethod
    def _json(resp: httpx.Response) -> dict[str, Any]:
        if resp.status_code >= 400:
            raise GatewayAdminError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: "
                                    f"{resp.text[:500]}")
        out: dict[str, Any] = resp.json()
        return out
