"""The pause gate: during a weight swap new calls wait (or get 429) and the swap waits for the
calls in flight to finish, so no call is served by half-loaded weights."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from lightning_middleware.asgi.error_replies import HTTPError

PAUSE_MODES = ("wait", "reject")


class PauseGate:
    """Admission of proxied calls. Lives on the gateway's event loop (events made on first use)."""

    def __init__(self, *, mode: str = "wait", wait_s: float = 30.0, retry_after_s: int = 2) -> None:
        self.mode, self.wait_s, self.retry_after_s = mode, wait_s, retry_after_s
        self.paused = False
        self.in_flight = 0
        self.waiting = 0  # calls waiting out a pause right now
        self.rejected = 0
        self._resumed: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._resumed is None or self._idle is None:
            self._resumed, self._idle = asyncio.Event(), asyncio.Event()
            self._resumed.set()
            self._idle.set()
        return self._resumed, self._idle

    async def pause(self, *, wait: bool = True, timeout: float = 60.0, mode: str | None = None) -> bool:
        """Stop admitting calls; with `wait`, return once in-flight calls have finished (or `timeout`).
        Returns whether none is in flight."""
        resumed, idle = self._events()
        if mode is not None:
            if mode not in PAUSE_MODES:
                raise HTTPError(400, "mode must be 'wait' or 'reject'")
            self.mode = mode
        self.paused = True
        resumed.clear()
        if wait and self.in_flight:
            try:
                await asyncio.wait_for(idle.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.in_flight == 0

    def resume(self) -> None:
        resumed, _ = self._events()
        self.paused = False
        resumed.set()

    async def admit(self) -> None:
        """Wait out a pause (or refuse with 429 + Retry-After); count the call in flight."""
        resumed, idle = self._events()
        if self.paused:
            retry = {"Retry-After": str(self.retry_after_s)}
            if self.mode == "reject":
                self.rejected += 1
                raise HTTPError(429, "the gateway is paused for a weight update; retry later", type="paused",
                                headers=retry)
            await self._wait_out(resumed, retry)
        self.in_flight += 1
        idle.clear()

    async def _wait_out(self, resumed: asyncio.Event, retry: dict[str, str]) -> None:
        deadline = time.monotonic() + self.wait_s
        self.waiting += 1
        try:
            while self.paused:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise asyncio.TimeoutError
                    await asyncio.wait_for(resumed.wait(), left)
                except asyncio.TimeoutError:
                    self.rejected += 1
                    raise HTTPError(429, f"the gateway stayed paused for {self.wait_s:g}s (weight update); "
                                    "retry later", type="paused", headers=retry) from None
        finally:
            self.waiting -= 1

    def release(self) -> None:
        _, idle = self._events()
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            idle.set()

    def snapshot(self) -> dict[str, Any]:
        return {"paused": self.paused, "pause_mode": self.mode, "in_flight": self.in_flight, "waiting": self.waiting}
