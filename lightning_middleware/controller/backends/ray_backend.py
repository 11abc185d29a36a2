"""Rollouts on Ray actors, on a local runtime or an existing cluster. Ray is imported on start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_middleware.controller.execution import AgentFn, aexecute_job, execute_job, failure, resolve_agent
from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome, WorkerLost, type_names
from lightning_middleware.records import RolloutStatus
from lightning_middleware.store import TraceStore


class RayBackend:
    """Rollouts on Ray actors: `num_workers` actors, each running up to
    `per_worker_concurrency` rollouts at once (async agents as tasks, sync agents
    in the actor's threads). Actors restart when they die; the rollouts they were
    running end as failed (WorkerLost). Connects to `address` (an existing
    cluster, e.g. "ray://head:10001" or "auto"), or starts a local Ray runtime.

    With several machines the store must be one every worker can reach (PostgreSQL).
    """

    name = "ray"
    out_of_process = True

    def __init__(self, address: str | None = None, *, num_workers: int = 2, per_worker_concurrency: int = 32,
                 init_kwargs: dict[str, Any] | None = None, actor_options: dict[str, Any] | None = None,
                 kill_grace_s: float = 5.0) -> None:
        self.address = address
        self.num_workers = num_workers
        self.per_worker_concurrency = per_worker_concurrency
        self.init_kwargs = dict(init_kwargs or {})
        self.actor_options = dict(actor_options or {})
        self.kill_grace_s = kill_grace_s
        self._actors: list[Any] = []
        self._next = 0

    def start(self, agent: AgentFn | str, store: TraceStore) -> None:
        import ray

        if not ray.is_initialized():
            kwargs = dict(self.init_kwargs)
            if self.address is None:  # local runtime: let workers import what this process imports
                kwargs.setdefault("include_dashboard", False)
                env = kwargs.setdefault("runtime_env", {}).setdefault("env_vars", {})
                paths = [os.getcwd(), str(Path(__file__).resolve().parents[3])]  # the repository root
                if os.environ.get("PYTHONPATH"):
                    paths.append(os.environ["PYTHONPATH"])
                env.setdefault("PYTHONPATH", os.pathsep.join(paths))
            ray.init(address=self.address, **kwargs)
        self._ray = ray
        if self._actors:
            return
        actor_cls = ray.remote(_RayRolloutWorker)
        opts = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0,
                "max_concurrency": self.per_worker_concurrency, **self.actor_options}
        self._actors = [actor_cls.options(**opts).remote(agent, self.per_worker_concurrency)
                        for _ in range(self.num_workers)]
        ray.get([a.ready.remote() for a in self._actors])

    def worker_pids(self) -> list[int]:
        return self._ray.get([a.pid.remote() for a in self._actors])

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        ray = self._ray
        actor = self._actors[self._next % len(self._actors)]
        self._next += 1
        t0 = time.monotonic()
        ref = actor.run.remote(job)
        limit = None if job.timeout_s is None else job.timeout_s + self.kill_grace_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), limit)
        except asyncio.TimeoutError:
            ray.cancel(ref)
            return RolloutOutcome(status=RolloutStatus.TIMEOUT.value,
                                  error=f"TimeoutError: rollout exceeded its {job.timeout_s:g}s timeout",
                                  error_types=tuple(type_names(TimeoutError)), duration_s=time.monotonic() - t0,
                                  ended_by_controller=True)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError) as exc:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            out = failure(WorkerLost(f"ray worker lost while running rollout {job.rollout_id}: {first}"), t0, None)
            return replace(out, ended_by_controller=True)

    def close(self) -> None:
        for a in self._actors:
            try:
                self._ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []


class _RayRolloutWorker:
    """A Ray actor (async: sync agents run in its own thread pool)."""

    def __init__(self, agent: AgentFn | str, threads: int) -> None:
        self.agent = resolve_agent(agent)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="rollout")

    async def ready(self) -> bool:
        return True

    async def pid(self) -> int:
        return os.getpid()

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        if inspect.iscoroutinefunction(self.agent):
            return await aexecute_job(self.agent, job)
        return await asyncio.get_running_loop().run_in_executor(self.pool, execute_job, self.agent, job)
