"""Errors the gateway answers with: OpenAI-style JSON bodies, upstream failures named as callers
know them, and the configuration errors that stop it from starting."""

from __future__ import annotations

import json
import logging

from lightning_middleware.asgi.replies import JSON_HEADERS, Full
from lightning_middleware.store import StoreError

log = logging.getLogger(__name__)


class GatewayConfigError(ValueError):
    """The gateway was configured unsafely or inconsistently; the message says what to fix."""


class HTTPError(Exception):
    """An error answer: status, OpenAI-style body, extra headers."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type, code, headers or {}
        self.param = param  # the request field at fault, where one is

    def body(self) -> bytes:
        error: dict[str, object] = {"message": self.message, "type": self.type, "code": self.code or self.status}
        if self.param is not None:
            error["param"] = self.param
        return json.dumps({"error": error}).encode()

    def reply(self) -> Full:
        return Full(self.status, [*JSON_HEADERS, *((k.lower().encode("latin-1"), v.encode("latin-1"))
                                                     for k, v in self.headers.items())], self.body())


def failure_name(exc: BaseException) -> str:
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


def unreachable(exc: BaseException) -> bool:
    """Nothing reached the replica (so another one may be tried)."""
    import aiohttp

    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def upstream_error(exc: BaseException, where: str | None) -> HTTPError:
    name = failure_name(exc)
    if name.endswith("Timeout"):
        return HTTPError(504, f"upstream {where or '?'} timed out ({name})", type="upstream_timeout",
                          code="upstream_timeout")
    return HTTPError(502, f"upstream {where or '?'} failed: {name}: {exc}", type="upstream_error",
                      code="upstream_error")


def error_reply(exc: BaseException, method: str, path: str) -> Full:
    """The JSON error a failed request gets: its own status for `HTTPError`, 503 when the trace store
    is down (retry later), 500 (logged) for anything else."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, HTTPError):
        return exc.reply()
    if isinstance(exc, (StoreError, sa_exc.SQLAlchemyError)):
        log.warning("trace store error on %s %s: %s", method, path, exc)
        return HTTPError(503, "the trace store is unavailable; retry later", type="store_unavailable",
                          code="store_unavailable", headers={"Retry-After": "5"}).reply()
    log.error("gateway error on %s %s", method, path, exc_info=exc)
    return HTTPError(500, f"gateway error: {type(exc).__name__}", type="server_error").reply()
