"""In-process backends: async agents on the controller's event loop, sync agents in threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time

from lightning_middleware.controller.execution import AgentFn, aexecute_job, execute_job, worker_name
from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome, type_names
from lightning_middleware.records import RolloutStatus
from lightning_middleware.store import TraceStore


class AsyncioBackend:
    """Async agents as tasks on the controller's event loop."""

    name = "asyncio"
    out_of_process = False

    def start(self, agent: AgentFn, store: TraceStore) -> None:
        if not inspect.iscoroutinefunction(agent):
            raise TypeError("the asyncio backend needs an `async def` agent; use backend='thread' for sync agents")
        self._agent, self._store = agent, store

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        return await aexecute_job(self._agent, job, self._store)

    def close(self) -> None:
        pass


class ThreadBackend:
    """Sync agents in a thread pool. A thread can't be killed: at the deadline the
    controller ends the rollout as timeout and frees the slot; the thread's late
    result is discarded (and recorded as timeout by its own rollout block)."""

    name = "thread"
    out_of_process = False

    def __init__(self, max_workers: int = 8) -> None:
        self.max_workers = max_workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._running = 0  # jobs whose thread is still running (abandoned ones included)
        self._changed = threading.Condition()

    def start(self, agent: AgentFn, store: TraceStore) -> None:
        self._agent, self._store = agent, store
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="rollout")

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        assert self._pool is not None
        t0 = time.monotonic()
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._execute, job)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), job.timeout_s)
        except asyncio.TimeoutError:
            return RolloutOutcome(status=RolloutStatus.TIMEOUT.value,
                                  error=f"TimeoutError: rollout exceeded its {job.timeout_s:g}s timeout",
                                  error_types=tuple(type_names(TimeoutError)), duration_s=time.monotonic() - t0,
                                  worker=worker_name(), ended_by_controller=True)

    def _execute(self, job: RolloutJob) -> RolloutOutcome:
        with self._changed:
            self._running += 1
        try:
            return execute_job(self._agent, job, self._store)
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job thread runs, timed-out ones included; True if that happened in time."""
        with self._changed:
            return self._changed.wait_for(lambda: self._running == 0, timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
