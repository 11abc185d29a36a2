"""In-process backends: async agents on the controller's event loop, sync agents in threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

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


class DaemonThreadPool(concurrent.futures.Executor):
    """A thread pool whose threads are daemons. `ThreadPoolExecutor`'s are joined when the
    interpreter exits, so a run stopped with Ctrl-C waited for every agent call still in flight
    (58 s after the Ctrl-C, with the rollouts already recorded as cancelled): an agent the
    controller has given up on, at its deadline or on cancellation, must not hold the process."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "pool") -> None:
        self._max, self._prefix = max_workers, thread_name_prefix
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # released by a thread that finished a job and waits for the next
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._jobs.put((future, functools.partial(fn, *args, **kwargs)))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # as ThreadPoolExecutor: the caller's future carries it
                    future.set_exception(exc)
            del job, future, fn
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for thread in threads:
                thread.join()


class ThreadBackend:
    """Sync agents in a thread pool. A thread can't be killed: at the deadline the
    controller ends the rollout as timeout and frees the slot; the thread's late
    result is discarded (and recorded as timeout by its own rollout block)."""

    name = "thread"
    out_of_process = False

    def __init__(self, max_workers: int = 8) -> None:
        self.max_workers = max_workers
        self._pool: DaemonThreadPool | None = None
        self._running = 0  # jobs whose thread is still running (abandoned ones included)
        self._changed = threading.Condition()

    def start(self, agent: AgentFn, store: TraceStore) -> None:
        self._agent, self._store = agent, store
        if self._pool is None:
            self._pool = DaemonThreadPool(self.max_workers, thread_name_prefix="rollout")

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
