"""Rollouts that a confined worker runs and the gateway records, for the backends whose workers
never hold the store or the gateway's token (sandboxed.py, and k8s.py with `gateway=`).

The backend, which holds the gateway's token, creates each rollout at the gateway, gives the worker
only that rollout's route (and, off this machine, its rollout-scoped token), and finishes it there
with the worker's verdict: the number the agent returned is posted as its reward first, unless the
reward configuration refuses the rollout's own rewards (then the gateway scores it alone). A breach
the gateway saw (a refused route or reward, recorded as a `sandbox_breach` event) is authoritative:
the agent may have caught the error it got.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import httpx

from lightning_middleware.asgi.auth import rollout_token
from lightning_middleware.controller.execution import failure
from lightning_middleware.controller.jobs import BREACHES, RolloutJob, RolloutOutcome, SandboxBreach, type_names
from lightning_middleware.records import SANDBOX_BREACH, RolloutStatus
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)


class GatewayRollouts:
    """Create and finish rollouts at the gateway at `url`, with its `token`."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def scoped_token(self, rollout_id: str) -> str:
        """The token a worker off this machine gets: `rollout_id`'s own routes and nothing else."""
        if not self.token:
            raise ValueError("a rollout-scoped token needs the gateway's token")
        return rollout_token(self.token, rollout_id)

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # a controller run is one event loop
            self._client, self._loop = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)), loop
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        return await self._client.request(method, self.url + path, json=body, headers=headers)

    async def create(self, job: RolloutJob, t0: float, worker: str) -> RolloutOutcome | None:
        """Create `job`'s rollout at the gateway: None when it is there, else the outcome of an
        infrastructure failure (the controller ends it and its retry policy may run it again)."""
        try:
            made = await self.request("POST", "/rollouts", {"id": job.rollout_id, "task_id": job.task_id,
                                                            "mode": job.mode, "metadata": job.metadata,
                                                            "input": job.task})
            made.raise_for_status()
        except httpx.HTTPError as exc:
            return replace(failure(exc, t0, worker), ended_by_controller=True)
        return None

    def breach_seen(self, store: TraceStore, rollout_id: str) -> tuple[type[SandboxBreach], str] | None:
        """The first breach the gateway recorded for the rollout (its rollout-scoped token was
        refused somewhere), with what it said."""
        for event in store.events(kind=SANDBOX_BREACH, source="gateway"):
            if event.data.get("rollout_id") == rollout_id and event.data.get("class") in BREACHES:
                return BREACHES[event.data["class"]], event.message
        return None

    async def finish(self, job: RolloutJob, t0: float, status: str, error: str | None,
                     breach: type[SandboxBreach] | None, value: Any, worker: str | None,
                     error_types: tuple[str, ...] = ()) -> RolloutOutcome:
        """Post the agent's returned reward (when it succeeded) and finish the rollout at the gateway;
        the outcome carries the gateway's final reward."""
        rid = job.rollout_id
        reward = value.get("reward") if isinstance(value, dict) else value
        succeeded = status == RolloutStatus.SUCCEEDED.value
        if succeeded and isinstance(reward, (int, float)):
            posted = await self.request("POST", f"/rollouts/{rid}/reward", {"value": float(reward)})
            if posted.status_code == 403:  # agent_reward = false: the returned number is not stored
                log.debug("rollout %s: its returned reward was refused by the reward configuration", rid)
            elif posted.status_code >= 400:
                log.warning("rollout %s: the gateway refused its reward: %s", rid, posted.text[:300])
        done = await self.request("POST", f"/rollouts/{rid}/finish", {"status": status, "error": error})
        final = done.json().get("final_reward") if done.status_code < 400 else None
        if done.status_code >= 400:
            log.warning("rollout %s: the gateway refused its finish: %s", rid, done.text[:300])
        types = tuple(type_names(breach)) if breach is not None else error_types
        if final is None and succeeded and isinstance(reward, (int, float)):
            final = float(reward)
        return RolloutOutcome(status=status, reward=final, error=error, error_types=types,
                              duration_s=time.monotonic() - t0, worker=worker,
                              ended_by_controller=done.status_code >= 400)

    def close(self) -> None:
        """Close the HTTP client, from outside its loop or after it ended."""
        client, loop, self._client, self._loop = self._client, self._loop, None, None
        if client is None or loop is None or loop.is_closed():
            return
        try:
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(client.aclose(), loop)
            else:
                loop.run_until_complete(client.aclose())
        except RuntimeError:
            pass
