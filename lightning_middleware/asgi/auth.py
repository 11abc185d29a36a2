"""Who may use the gateway: the bearer token every route but /health needs when one is set,
compared in constant time; without a token, loopback only (a gateway that listens off loopback
must have one, and a request from off loopback is refused).

A rollout-scoped token (`rollout_token`) is derived from the gateway's token by HMAC and opens
only one rollout's own routes (its LLM calls, reading it, its reward): what a confined rollout
(a sandbox, a pod) holds instead of the gateway's token. The gateway checks it without storing
anything, and it names its rollout, so a refused use is that rollout's breach."""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import re
from collections.abc import Sequence
from typing import Any

from lightning_middleware.asgi.error_replies import GatewayConfigError, HTTPError

TOKEN_ENV = "LIGHTNING_GATEWAY_TOKEN"
_TOKEN_RE = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an Authorization header carries intact


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str) -> bool:
    """Is `host` (a bind address or a client's address) this machine's loopback?"""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback  # ::ffff:127.0.0.1, from a dual-stack socket
    return ip.is_loopback


def checked_token(token: str | None) -> str | None:
    """The token to require (None or "": none), refused unless it is visible ASCII."""
    if not token:
        return None
    if not _TOKEN_RE.fullmatch(token):
        raise GatewayConfigError("the gateway token must be visible ASCII without spaces "
                                 "(it travels in an Authorization header)")
    return token


def tokens_match(given: str, token: str) -> bool:
    """Constant-time comparison; both sides are hashed first, so the time does not depend on the
    token's length either."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(token.encode()).digest())


ROLLOUT_TOKEN_PREFIX = "lmr1."
_MAC_HEX = 64


def rollout_token(token: str, rollout_id: str) -> str:
    """The bearer token for `rollout_id`'s own routes at a gateway whose token is `token`."""
    mac = hmac.new(token.encode(), f"rollout:{rollout_id}".encode(), hashlib.sha256).hexdigest()
    return f"{ROLLOUT_TOKEN_PREFIX}{mac}.{rollout_id}"


def scoped_rollout(token: str | None, authorization: str) -> str | None:
    """The rollout a genuine rollout-scoped bearer token in `authorization` names, else None."""
    scheme, _, value = authorization.partition(" ")
    value = value.strip()
    if not token or scheme.lower() != "bearer" or not value.startswith(ROLLOUT_TOKEN_PREFIX):
        return None
    rid = value[len(ROLLOUT_TOKEN_PREFIX) + _MAC_HEX + 1:]
    return rid if rid and tokens_match(value, rollout_token(token, rid)) else None


def check_bearer(token: str | None, authorization: str) -> None:
    """Raise a 401 unless `authorization` is "Bearer <token>"; no token: open."""
    if not token:
        return
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not tokens_match(value.strip(), token):
        raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                        type="authentication_error", code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def check_client(token: str | None, client: Sequence[Any] | None) -> None:
    """Without a token, only loopback clients are served (a 403 otherwise): an app from
    `build_app` served on another address by another server stays closed to the network."""
    if token or not client:
        return
    if not is_loopback(str(client[0])):
        raise HTTPError(403, "this gateway has no token, so it serves loopback clients only; "
                             f"start it with a token (--token or ${TOKEN_ENV})",
                        type="permission_error", code="forbidden")
