"""Bearer-token checks for every route but /health, and the rule that a gateway listening off
loopback must have a token."""

from __future__ import annotations

import hmac
import ipaddress

from lightning_middleware.gateway.errors import HTTPError

TOKEN_ENV = "LIGHTNING_GATEWAY_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bearer(token: str | None, authorization: str) -> None:
    """Raise a 401 unless `authorization` is "Bearer <token>" (constant-time); no token: open."""
    if not token:
        return
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
        raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                        type="authentication_error", code="unauthorized", headers={"WWW-Authenticate": "Bearer"})
