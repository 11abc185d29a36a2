"""The vLLM replicas behind the gateway: sticky choice per rollout, round robin otherwise,
health checks, and a replica marked down when a call cannot reach it."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # aiohttp and yarl are imported when the gateway starts
    import aiohttp
    import yarl

from lightning_middleware.asgi.error_replies import GatewayConfigError, failure_name

log = logging.getLogger(__name__)


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
        self.host = urlsplit(self.url).hostname or ""
        self._endpoints: dict[str, Any] = {}

    def endpoint(self, path: str) -> yarl.URL:
        """`{url}/v1/{path}` as a parsed URL, parsed once (aiohttp would parse the string every call)."""
        url = self._endpoints.get(path)
        if url is None:
            from yarl import URL

            url = self._endpoints[path] = URL(f"{self.url}/v1/{path}")
        return url

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "healthy": self.healthy, "last_check": self.last_check,
                "last_error": self.last_error, "active": self.active}


    def mark_down(self, error: str) -> None:
        self.healthy, self.last_error, self.last_check = False, error, time.time()


def root_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        raise GatewayConfigError(f"upstream must be an http(s) URL, got {url!r}")
    return url[:-3] if url.endswith("/v1") else url


def rendezvous(key: str, upstreams: Sequence[Upstream]) -> Upstream:
    """Highest-random-weight choice: stable per key, and only the keys of a lost replica move."""
    return max(upstreams, key=lambda u: hashlib.blake2b(f"{key}|{u.url}".encode(), digest_size=8).digest())


class UpstreamPool:
    """The replicas, and which one serves a call."""

    def __init__(self, urls: Sequence[str], *, health_timeout_s: float = 2.0) -> None:
        self.upstreams = [Upstream(i, root_url(u)) for i, u in enumerate(urls)]
        self.health_timeout_s = health_timeout_s
        self._rr = itertools.count()

    def __iter__(self) -> Iterator[Upstream]:
        return iter(self.upstreams)

    def __len__(self) -> int:
        return len(self.upstreams)

    def pick(self, rollout_id: str | None, tried: set[int]) -> Upstream | None:
        """A healthy replica not tried yet for this call (any untried one if none is healthy):
        the same one for every call of a rollout (its prefix cache), round robin otherwise."""
        left = [u for u in self.upstreams if u.index not in tried]
        if not left:
            return None
        healthy = [u for u in left if u.healthy] or left
        if len(healthy) == 1:
            return healthy[0]
        if rollout_id:
            return rendezvous(rollout_id, healthy)
        return healthy[next(self._rr) % len(healthy)]

    async def check(self, session: aiohttp.ClientSession, u: Upstream) -> None:
        import aiohttp

        try:
            async with session.get(u.url + "/health", timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as r:
                ok, err = r.status == 200, None if r.status == 200 else f"health HTTP {r.status}"
        except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
            ok, err = False, f"{failure_name(exc)}: {exc}"
        if ok != u.healthy:
            log.warning("upstream %s is now %s%s", u.url, "healthy" if ok else "unhealthy", f" ({err})" if err else "")
        u.healthy, u.last_error, u.last_check = ok, err, time.time()

    async def check_health(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, u) for u in self.upstreams))

    async def health_loop(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        while True:
            try:
                await self.check_health(session)
            except Exception:  # pragma: no cover - never let the loop die
                log.exception("health check failed")
            await asyncio.sleep(interval_s)
