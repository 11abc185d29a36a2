"""The backend seam: where a rollout job runs (this event loop, a thread, a process, a Ray actor)."""

from __future__ import annotations

from typing import Protocol

from lightning_middleware.controller.execution import AgentFn
from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome
from lightning_middleware.store import TraceStore


class Backend(Protocol):
    """The seam: start once, run jobs (each awaited by the controller), close.

    `run` must never raise for an agent error; it returns an outcome. It sets
    `ended_by_controller` when the rollout's own process could not end it in the
    store (worker died, hard timeout); the controller then ends it.
    """

    name: str
    # True when jobs run in other processes: the agent is sent by reference ("module:function"
    # or a module-level function) and reaches the store by its URL, so an in-memory store or a
    # closure cannot be used; the controller ends such rollouts in the store when a worker dies.
    out_of_process: bool

    def start(self, agent: AgentFn, store: TraceStore) -> None: ...

    async def run(self, job: RolloutJob) -> RolloutOutcome: ...

    def close(self) -> None: ...
