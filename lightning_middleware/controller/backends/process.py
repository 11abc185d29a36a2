"""A pool of worker processes, one rollout at a time each; a killed worker fails only its rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace
from typing import Any

from lightning_middleware.controller.execution import AgentFn, execute_job, failure, resolve_agent
from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome, WorkerLost, type_names
from lightning_middleware.records import RolloutStatus
from lightning_middleware.store import TraceStore


def _process_worker_main(conn: Any, agent_ref: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the controller, which closes us
    agent = resolve_agent(agent_ref)
    conn.send("ready")  # imports done: the parent starts the job's clock only now
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        outcome = execute_job(agent, job)
        try:
            conn.send(outcome)
        except (BrokenPipeError, OSError):
            return


class _Proc:
    def __init__(self, ctx: Any, agent_ref: Any, startup_timeout_s: float = 120.0) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.conn = parent
        self.proc = ctx.Process(target=_process_worker_main, args=(child, agent_ref), daemon=True,
                                name="lightning-rollout-worker")
        self.proc.start()
        child.close()
        # Wait for the worker's imports, so its start-up never eats a rollout's timeout.
        try:
            ok = parent.poll(startup_timeout_s) and parent.recv() == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            self.kill()
            raise WorkerLost(f"worker process {self.proc.pid} did not start within {startup_timeout_s:g}s")

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class ProcessBackend:
    """A pool of worker processes (one rollout at a time each).

    The agent must be picklable by reference (a module-level function) or given
    as "module:function". A worker that dies (OOM, kill -9) fails the rollout it
    was running (its spans already flushed stay in the store) and is replaced.
    At the timeout a sync agent gets TimeoutError from SIGALRM (an async one is
    cancelled), so the rollout ends as timeout with its spans; a worker that still
    doesn't answer `kill_grace_s` later is killed.
    """

    name = "process"
    out_of_process = True

    def __init__(self, workers: int | None = None, *, start_method: str = "spawn", kill_grace_s: float = 5.0) -> None:
        self.workers = workers or os.cpu_count() or 2
        self.start_method = start_method
        self.kill_grace_s = kill_grace_s
        self._procs: list[_Proc] = []
        self._idle: list[_Proc] = []
        self._lock = threading.Lock()
        self._free: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, agent: AgentFn | str, store: TraceStore) -> None:
        import multiprocessing

        self._ctx = multiprocessing.get_context(self.start_method)
        self._agent_ref = agent

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None and p.proc.is_alive()]

    def _take(self) -> _Proc:
        with self._lock:
            while self._idle:
                p = self._idle.pop()
                if p.proc.is_alive():
                    return p
                self._drop(p)
        p = _Proc(self._ctx, self._agent_ref)  # outside the lock: workers start in parallel
        with self._lock:
            self._procs.append(p)
        return p

    def _drop(self, p: _Proc) -> None:
        if p in self._procs:
            self._procs.remove(p)

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:
            self._free, self._loop = asyncio.Semaphore(self.workers), loop
        async with self._free:
            p = await asyncio.to_thread(self._take) if not self._idle else self._take()
            t0 = time.monotonic()
            try:
                p.conn.send(job)
            except (BrokenPipeError, OSError):
                return self._lost(p, job, t0)
            ready = loop.create_future()
            fd = p.conn.fileno()
            loop.add_reader(fd, lambda: None if ready.done() else ready.set_result(None))
            limit = None if job.timeout_s is None else job.timeout_s + self.kill_grace_s
            try:
                await asyncio.wait_for(ready, limit)
            except asyncio.TimeoutError:
                loop.remove_reader(fd)
                await asyncio.to_thread(p.kill)
                with self._lock:
                    self._drop(p)
                return RolloutOutcome(status=RolloutStatus.TIMEOUT.value,
                                      error=f"TimeoutError: rollout exceeded its {job.timeout_s:g}s timeout "
                                            f"(worker {p.pid} killed)",
                                      error_types=tuple(type_names(TimeoutError)),
                                      duration_s=time.monotonic() - t0, worker=str(p.pid), ended_by_controller=True)
            except BaseException:
                loop.remove_reader(fd)
                await asyncio.to_thread(p.kill)
                with self._lock:
                    self._drop(p)
                raise
            loop.remove_reader(fd)
            try:
                outcome = p.conn.recv()
            except (EOFError, OSError):
                return await asyncio.to_thread(self._lost, p, job, t0)
            with self._lock:
                self._idle.append(p)
            return outcome

    def _lost(self, p: _Proc, job: RolloutJob, t0: float) -> RolloutOutcome:
        p.proc.join(2)
        code = p.proc.exitcode
        p.kill()
        with self._lock:
            self._drop(p)
        exc = WorkerLost(f"worker process {p.pid} died (exit code {code}) while running rollout {job.rollout_id}")
        out = failure(exc, t0, str(p.pid))
        return replace(out, ended_by_controller=True)

    def close(self) -> None:
        with self._lock:
            procs, self._procs, self._idle = self._procs, [], []
        for p in procs:
            try:
                p.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.proc.join(2)
            p.kill()
