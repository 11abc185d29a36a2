"""Rollout controller: run an agent function over a task set, n samples per task.

The agent contract (see docs/controller.md):

    def agent(task: dict) -> float | dict | None      # or `async def`

- It is called once per rollout, inside `rollout(task_id, input=task, ...)`, so
  every LLM call it makes through a `wrap()`ed client is recorded under that rollout.
- Return the reward (a number or bool), or `{"reward": x, ...}` (the other keys
  become the reward's metadata), or None after calling `emit_reward()` yourself.
- Raise to fail the rollout. Exceptions whose type matches the `RetryPolicy`
  (infrastructure errors) start a new rollout of the same sample; a low reward
  is never retried.

The controller does the scheduling (concurrency limit, retries, pause/drain,
leases, policy-version tags, continuous mode) in one asyncio loop; a `Backend`
only runs one job and reports its outcome. Backends: "asyncio" (async agents),
"thread" (sync agents), "process" (a pool of worker processes; a killed worker
fails only its rollout), "ray" (actors on a Ray cluster). Ray is imported only
when the Ray backend starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .context import RolloutHandle, rollout
from .records import Mode, Rollout, RolloutStatus
from .store import TraceStore, get_store

log = logging.getLogger(__name__)

AgentFn = Callable[[dict[str, Any]], Any]


class WorkerLost(RuntimeError):
    """The process (or Ray actor) running a rollout died before reporting back."""


class _Deadline(BaseException):
    """Raised by SIGALRM in a worker's main thread; BaseException so HTTP stacks don't swallow it."""


# --------------------------------------------------------------------------
# Policy, jobs, outcomes
# --------------------------------------------------------------------------

DEFAULT_RETRY_ON: tuple[str, ...] = (
    "ConnectionError",  # builtins: refused/reset connections
    "openai.APIConnectionError",  # includes APITimeoutError
    "httpx.TransportError",
    "httpx2.TransportError",
    "lightning_middleware.controller.WorkerLost",
)


def _type_names(exc_type: type) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in exc_type.__mro__ if c not in (object, BaseException)]


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a rollout (as a new rollout of the same sample) when it raised an infrastructure error.

    `retry_on` holds exception types or names: "ConnectionError" (a builtin),
    "openai.APIConnectionError" (package + class name) or a full
    "module.Class". A subclass matches. Only exceptions retry: a rollout that
    returned a low reward is a result, not an error.
    """

    max_attempts: int = 3
    retry_on: tuple[type[BaseException] | str, ...] = DEFAULT_RETRY_ON
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def matches(self, error_types: Sequence[str]) -> bool:
        """True if an exception with these "module.Class" MRO names should be retried."""
        for want in self.retry_on:
            name = f"{want.__module__}.{want.__qualname__}" if isinstance(want, type) else want
            if any(_name_match(name, have) for have in error_types):
                return True
        return False

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2 ** (attempt - 1))) * (0.5 + random.random() / 2)


def _name_match(want: str, have: str) -> bool:
    """`have` is "module.Qualname"; `want` is "Class", "pkg.Class" or "module.Class"."""
    if want == have:
        return True
    h_mod, _, h_cls = have.rpartition(".")
    if "." not in want:
        return h_mod == "builtins" and h_cls == want
    w_mod, _, w_cls = want.rpartition(".")
    return w_cls == h_cls and (h_mod == w_mod or h_mod.startswith(w_mod + "."))


@dataclass(frozen=True)
class RolloutJob:
    """One rollout to run: what a backend gets (picklable)."""

    rollout_id: str
    task_id: str
    task: dict[str, Any]
    sample_index: int = 0
    attempt: int = 1
    mode: str = Mode.TRAIN.value
    policy_version: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    store_url: str | None = None
    timeout_s: float | None = None
    created_at: float = 0.0


@dataclass(frozen=True)
class RolloutOutcome:
    """What a backend reports for one job (picklable).

    `ended_by_controller`: the rollout's own process could not close it (it died,
    or ran past the timeout and was stopped), so the controller ends it in the store.
    """

    status: str
    reward: float | None = None
    error: str | None = None
    error_types: tuple[str, ...] = ()
    duration_s: float = 0.0
    worker: str | None = None
    ended_by_controller: bool = False


@dataclass(frozen=True)
class RolloutResult:
    """The final result of one sample (after retries)."""

    rollout_id: str  # the last attempt's rollout
    task_id: str
    sample_index: int
    status: str
    reward: float | None
    error: str | None
    attempts: int
    policy_version: int | None
    duration_s: float
    rollout_ids: tuple[str, ...] = ()  # every attempt, oldest first
    mode: str = Mode.TRAIN.value


@dataclass
class ControllerStats:
    started: int = 0
    finished: int = 0
    retried: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    groups_started: int = 0
    groups_finished: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------
# Running one job (used by every backend, in whatever process runs it)
# --------------------------------------------------------------------------

def _apply_return(handle: RolloutHandle, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        value = float(value)
    if isinstance(value, (int, float)):
        handle.reward(float(value))
        return float(value)
    if isinstance(value, dict) and "reward" in value:
        reward = value["reward"]
        meta = {k: v for k, v in value.items() if k != "reward"}
        handle.reward(reward, metadata=meta or None)
        return float(reward)
    raise TypeError(f"agent must return a reward (number), a dict with 'reward', or None; got {type(value).__name__}")


def _failure(exc: BaseException, t0: float, worker: str | None) -> RolloutOutcome:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    status = RolloutStatus.TIMEOUT.value if isinstance(exc, TimeoutError) else RolloutStatus.FAILED.value
    return RolloutOutcome(status=status, error=text, error_types=tuple(_type_names(type(exc))),
                          duration_s=time.monotonic() - t0, worker=worker)


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _final_reward(store: TraceStore, rollout_id: str) -> float | None:
    found = store.get_rollout(rollout_id)
    return None if found is None else found.final_reward


def _scope(job: RolloutJob, store: TraceStore) -> Any:
    return rollout(job.task_id, input=job.task, mode=job.mode, metadata=job.metadata, store=store,
                   rollout_id=job.rollout_id, policy_version=job.policy_version)


def execute_job(agent: AgentFn, job: RolloutJob, store: TraceStore | None = None) -> RolloutOutcome:
    """Run a sync (or async, via asyncio.run) agent for one job in this thread.

    The timeout is enforced with SIGALRM when this is a process's main thread
    (worker processes); elsewhere (a thread pool) the agent can't be interrupted:
    the controller ends the rollout at the deadline and the late result is
    recorded as a timeout.
    """
    if inspect.iscoroutinefunction(agent):
        return asyncio.run(aexecute_job(agent, job, store))
    store = store or get_store(job.store_url)
    t0 = time.monotonic()
    deadline = None if job.timeout_s is None else t0 + job.timeout_s
    use_alarm = (job.timeout_s is not None and hasattr(signal, "setitimer")
                 and threading.current_thread() is threading.main_thread())
    reward: float | None = None
    try:
        with _scope(job, store) as handle:
            old = None
            if use_alarm:
                def _on_alarm(_sig: int, _frame: Any) -> None:
                    raise _Deadline()
                old = signal.signal(signal.SIGALRM, _on_alarm)
                signal.setitimer(signal.ITIMER_REAL, job.timeout_s)
            try:
                value = agent(job.task)
            except _Deadline:
                raise TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout") from None
            finally:
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, old)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout")
            reward = _apply_return(handle, value)
    except _Deadline:  # the alarm fired between the agent's return and disarming
        return _failure(TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout"), t0, _worker_name())
    except Exception as exc:
        return _failure(exc, t0, _worker_name())
    if reward is None:
        reward = _final_reward(store, job.rollout_id)
    return RolloutOutcome(status=RolloutStatus.SUCCEEDED.value, reward=reward,
                          duration_s=time.monotonic() - t0, worker=_worker_name())


async def aexecute_job(agent: AgentFn, job: RolloutJob, store: TraceStore | None = None) -> RolloutOutcome:
    """Run an async agent for one job; the timeout cancels it (the rollout ends as timeout)."""
    store = store or get_store(job.store_url)
    t0 = time.monotonic()
    reward: float | None = None
    try:
        async with _scope(job, store) as handle:
            try:
                value = await asyncio.wait_for(agent(job.task), job.timeout_s)
            except asyncio.TimeoutError:
                if time.monotonic() - t0 >= (job.timeout_s or 0.0):
                    raise TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout") from None
                raise
            reward = _apply_return(handle, value)
    except Exception as exc:
        return _failure(exc, t0, _worker_name())
    if reward is None:
        reward = await asyncio.to_thread(_final_reward, store, job.rollout_id)
    return RolloutOutcome(status=RolloutStatus.SUCCEEDED.value, reward=reward,
                          duration_s=time.monotonic() - t0, worker=_worker_name())


def resolve_agent(agent: AgentFn | str) -> AgentFn:
    """An agent function, or "package.module:function"."""
    if callable(agent):
        return agent
    if not isinstance(agent, str) or ":" not in agent:
        raise ValueError(f"agent must be a callable or 'module:function', got {agent!r}")
    mod, _, name = agent.partition(":")
    fn: Any = importlib.import_module(mod)
    for part in name.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{agent} is not callable")
    return fn


# --------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------

class Backend(Protocol):
    """The seam: start once, run jobs (each awaited by the controller), close.

    `run` must never raise for an agent error; it returns an outcome. It sets
    `ended_by_controller` when the rollout's own process could not end it in the
    store (worker died, hard timeout); the controller then ends it.
    """

    name: str

    def start(self, agent: AgentFn, store: TraceStore) -> None: ...

    async def run(self, job: RolloutJob) -> RolloutOutcome: ...

    def close(self) -> None: ...


class AsyncioBackend:
    """Async agents as tasks on the controller's event loop."""

    name = "asyncio"

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

    def __init__(self, max_workers: int = 8) -> None:
        self.max_workers = max_workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, agent: AgentFn, store: TraceStore) -> None:
        self._agent, self._store = agent, store
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="rollout")

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        assert self._pool is not None
        t0 = time.monotonic()
        fut = asyncio.get_running_loop().run_in_executor(self._pool, execute_job, self._agent, job, self._store)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), job.timeout_s)
        except asyncio.TimeoutError:
            return RolloutOutcome(status=RolloutStatus.TIMEOUT.value,
                                  error=f"TimeoutError: rollout exceeded its {job.timeout_s:g}s timeout",
                                  error_types=tuple(_type_names(TimeoutError)), duration_s=time.monotonic() - t0,
                                  worker=_worker_name(), ended_by_controller=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


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
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
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
                                      error_types=tuple(_type_names(TimeoutError)),
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
        out = _failure(exc, t0, str(p.pid))
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


class RayBackend:
    """Rollouts on Ray actors: `num_workers` actors, each running up to
    `per_worker_concurrency` rollouts at once (async agents as tasks, sync agents
    in the actor's threads). Actors restart when they die; the rollouts they were
    running end as failed (WorkerLost). Connects to `address` (an existing
    cluster, e.g. "ray://head:10001" or "auto"), or starts a local Ray runtime.

    With several machines the store must be one every worker can reach (PostgreSQL).
    """

    name = "ray"

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
                paths = [os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
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
                                  error_types=tuple(_type_names(TimeoutError)), duration_s=time.monotonic() - t0,
                                  ended_by_controller=True)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError) as exc:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            out = _failure(WorkerLost(f"ray worker lost while running rollout {job.rollout_id}: {first}"), t0, None)
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


def make_backend(backend: str | Backend, agent: AgentFn | str, *, concurrency: int,
                 workers: int | None = None, ray_address: str | None = None) -> Backend:
    if not isinstance(backend, str):
        return backend
    if backend == "auto":
        backend = "asyncio" if (callable(agent) and inspect.iscoroutinefunction(agent)) else "thread"
    if backend == "asyncio":
        return AsyncioBackend()
    if backend == "thread":
        return ThreadBackend(max_workers=workers or 2 * concurrency)  # room for abandoned (timed-out) threads
    if backend == "process":
        return ProcessBackend(workers=workers)
    if backend == "ray":
        return RayBackend(ray_address, num_workers=workers or 2,
                          per_worker_concurrency=max(1, -(-concurrency // (workers or 2))))
    raise ValueError(f"unknown backend {backend!r}: use auto, asyncio, thread, process or ray")


# --------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------

TaskSource = str | os.PathLike | Iterable[dict[str, Any]]


def load_tasks(tasks: Any, *, task_id_key: str = "task_id") -> list[tuple[str, dict[str, Any]]]:
    """(task_id, task) pairs from a JSONL path, a list of dicts, or a `datasets.Dataset`.

    The task id is `task[task_id_key]`, else `task["id"]`, else "task-<index>".
    """
    if isinstance(tasks, (str, os.PathLike)):
        rows: Iterable[Any] = []
        with open(tasks, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = tasks
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            row = dict(row)
        tid = row.get(task_id_key)
        if tid is None:
            tid = row.get("id")
        tid = f"task-{i}" if tid is None else str(tid)
        if tid in seen:
            raise ValueError(f"duplicate task id {tid!r}: task ids name GRPO groups and must be unique")
        seen.add(tid)
        out.append((tid, row))
    return out


# --------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------

class RolloutController:
    """Run `agent` over tasks with a concurrency limit, timeouts, retries, pause/drain and leases.

    `policy_version`: None reads `store.latest_policy_version()` when each
    rollout starts (cached `policy_version_ttl_s`), an int fixes it, a callable
    is asked. `lease_s`: in-flight rollouts get a heartbeat every lease_s/3;
    with `reap=True` the controller also ends running rollouts whose heartbeat
    is older than `lease_s` (a controller or machine that died).
    """

    def __init__(self, agent: AgentFn | str, *, store: TraceStore | str | None = None,
                 backend: str | Backend = "auto", concurrency: int = 8, timeout_s: float | None = None,
                 retry: RetryPolicy | None = None, policy_version: int | Callable[[], int | None] | None = None,
                 policy_version_ttl_s: float = 1.0, lease_s: float = 30.0, reap: bool = True,
                 metadata: dict[str, Any] | None = None, task_id_key: str = "task_id",
                 workers: int | None = None, ray_address: str | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.agent_ref = agent
        self.agent = resolve_agent(agent)
        self.store = get_store(store)
        self.backend = make_backend(backend, self.agent, concurrency=concurrency, workers=workers,
                                    ray_address=ray_address)
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.policy_version = policy_version
        self.policy_version_ttl_s = policy_version_ttl_s
        self.lease_s = lease_s
        self.reap = reap
        self.metadata = dict(metadata or {})
        self.task_id_key = task_id_key
        self.owner = f"{_worker_name()}:{uuid.uuid4().hex[:6]}"
        self.stats = ControllerStats()
        self._paused = False
        self._stopping = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[str, RolloutJob] = {}
        self._released: set[str] = set()
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._pv_cache: tuple[float, int | None] = (0.0, None)
        self._started = False
        self._sessions = 0
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------
    def _start_backend(self) -> None:
        if not self._started:
            agent: Any = self.agent_ref if isinstance(self.backend, (ProcessBackend, RayBackend)) else self.agent
            self.backend.start(agent, self.store)
            self._started = True

    def close(self) -> None:
        """Stop the backend (worker processes, Ray actors). The controller can't be reused after."""
        self.backend.close()
        self._started = False
        if self._loop is not None and self._loop_lock.acquire(blocking=False):
            try:
                self._loop.close()
            finally:
                self._loop_lock.release()

    def __enter__(self) -> "RolloutController":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    async def _enter_session(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.concurrency), loop
        if not self._started:
            await asyncio.to_thread(self._start_backend)
        self._sessions += 1
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = loop.create_task(self._heartbeat_loop())

    async def _exit_session(self) -> None:
        self._sessions -= 1
        if self._sessions == 0 and self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            try:
                await self._heartbeat_task
            except asyncio.CancelledError:
                pass
            self._heartbeat_task = None
            await asyncio.to_thread(self._beat)  # release what is left

    def _beat(self) -> None:
        with self._lock:
            running = list(self._in_flight)
            released, self._released = list(self._released), set()
        try:
            self.store.heartbeat(running, owner=self.owner)
            self.store.release_leases(released)
        except Exception as exc:  # noqa: BLE001 - a store hiccup must not kill the controller
            log.warning("rollout lease heartbeat failed: %s", exc)
            with self._lock:
                self._released.update(released)

    async def _heartbeat_loop(self) -> None:
        every = max(0.05, self.lease_s / 3)
        last_reap = 0.0
        while True:
            await asyncio.to_thread(self._beat)
            if self.reap and time.monotonic() - last_reap >= self.lease_s:
                last_reap = time.monotonic()
                try:
                    ended = await asyncio.to_thread(self.store.reap_stale, self.lease_s)
                    if ended:
                        log.warning("ended %d rollouts whose lease expired: %s", len(ended), ended[:5])
                except Exception as exc:  # noqa: BLE001
                    log.warning("reaping stale rollouts failed: %s", exc)
            await asyncio.sleep(every)

    # -- pause / drain -----------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def pause(self) -> None:
        """Start no new rollouts (queued ones wait); running ones continue. Thread-safe."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def drain(self, timeout: float | None = None) -> bool:
        """Pause, then wait (this thread) until no rollout is running. True if drained in time."""
        self.pause()
        end = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._in_flight:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    async def adrain(self, timeout: float | None = None) -> bool:
        """`drain` for code running on the controller's event loop."""
        self.pause()
        end = None if timeout is None else time.monotonic() + timeout
        while self.in_flight:
            if end is not None and time.monotonic() > end:
                return False
            await asyncio.sleep(0.01)
        return True

    def stop(self) -> None:
        """End continuous mode: start no new groups; running groups finish."""
        self._stopping = True

    # -- one rollout -------------------------------------------------------------
    async def _current_policy_version(self) -> int | None:
        pv = self.policy_version
        if isinstance(pv, int):
            return pv
        now = time.monotonic()
        at, cached = self._pv_cache
        if at and now - at < self.policy_version_ttl_s:
            return cached
        value = await asyncio.to_thread(pv if callable(pv) else self.store.latest_policy_version)
        self._pv_cache = (now, value)
        return value

    async def _run_one(self, job: RolloutJob) -> RolloutOutcome:
        with self._lock:
            self._in_flight[job.rollout_id] = job
            self.stats.started += 1
            self.stats.in_flight = len(self._in_flight)
            self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
        try:
            try:
                outcome = await self.backend.run(job)
            except asyncio.CancelledError:
                outcome = RolloutOutcome(status=RolloutStatus.FAILED.value, error="cancelled by the controller",
                                         ended_by_controller=True)
                await asyncio.shield(asyncio.to_thread(self._end_in_store, job, outcome))
                raise
            except Exception as exc:  # a backend bug or an unreachable cluster: fail this rollout
                log.exception("backend %s failed on rollout %s", self.backend.name, job.rollout_id)
                outcome = replace(_failure(exc, time.monotonic(), None), ended_by_controller=True)
            if outcome.ended_by_controller:
                await asyncio.to_thread(self._end_in_store, job, outcome)
            return outcome
        finally:
            with self._idle:
                self._in_flight.pop(job.rollout_id, None)
                self._released.add(job.rollout_id)
                self.stats.in_flight = len(self._in_flight)
                self.stats.finished += 1
                self._idle.notify_all()

    def _end_in_store(self, job: RolloutJob, outcome: RolloutOutcome) -> None:
        if not isinstance(self.backend, (ProcessBackend, RayBackend)):
            self.store.flush(5.0)  # same process: let the row land first
        template = Rollout(id=job.rollout_id, task_id=job.task_id, mode=job.mode, input=job.task,
                           metadata=job.metadata, policy_version=job.policy_version,
                           created_at=job.created_at or time.time())
        self.store.end_rollout_if_running(template, status=outcome.status, error=outcome.error)

    async def _sample(self, task_id: str, task: dict[str, Any], index: int, mode: str,
                      extra: dict[str, Any] | None = None) -> RolloutResult:
        assert self._sem is not None
        ids: list[str] = []
        attempt = 0
        while True:
            attempt += 1
            async with self._sem:
                while self._paused:
                    await asyncio.sleep(0.02)
                pv = await self._current_policy_version()
                meta = {**self.metadata, **(extra or {}), "sample_index": index, "attempt": attempt}
                if ids:
                    meta["retry_of"] = ids[-1]
                job = RolloutJob(rollout_id=uuid.uuid4().hex, task_id=task_id, task=task, sample_index=index,
                                 attempt=attempt, mode=mode, policy_version=pv, metadata=meta,
                                 store_url=self.store.url.render_as_string(hide_password=False),
                                 timeout_s=self.timeout_s, created_at=time.time())
                ids.append(job.rollout_id)
                outcome = await self._run_one(job)
            with self._lock:
                self.stats.by_status[outcome.status] = self.stats.by_status.get(outcome.status, 0) + 1
            if (outcome.status == RolloutStatus.FAILED.value and attempt < self.retry.max_attempts
                    and self.retry.matches(outcome.error_types)):
                with self._lock:
                    self.stats.retried += 1
                log.info("retrying task %s sample %d after %s", task_id, index, outcome.error)
                await asyncio.sleep(self.retry.delay(attempt))
                continue
            return RolloutResult(rollout_id=job.rollout_id, task_id=task_id, sample_index=index,
                                 status=outcome.status, reward=outcome.reward, error=outcome.error,
                                 attempts=attempt, policy_version=pv, duration_s=outcome.duration_s,
                                 rollout_ids=tuple(ids), mode=mode)

    async def _group(self, task_id: str, task: dict[str, Any], n: int, mode: str,
                     extra: dict[str, Any] | None = None) -> list[RolloutResult]:
        with self._lock:
            self.stats.groups_started += 1
        results = await asyncio.gather(*(self._sample(task_id, task, i, mode, extra) for i in range(n)))
        with self._lock:
            self.stats.groups_finished += 1
        return list(results)

    # -- batch mode --------------------------------------------------------------
    async def arun(self, tasks: Any, *, n: int = 1, mode: str = Mode.TRAIN.value,
                   metadata: dict[str, Any] | None = None) -> list[RolloutResult]:
        """Run n samples of every task (each task one group); results in task, sample order."""
        if n < 1:
            raise ValueError("n must be >= 1")
        pairs = load_tasks(tasks, task_id_key=self.task_id_key)
        await self._enter_session()
        try:
            groups = await asyncio.gather(*(self._group(tid, task, n, mode, metadata) for tid, task in pairs))
        finally:
            await self._exit_session()
        return [r for g in groups for r in g]

    def run(self, tasks: Any, *, n: int = 1, mode: str = Mode.TRAIN.value,
            metadata: dict[str, Any] | None = None) -> list[RolloutResult]:
        """Blocking `arun` (not from inside a running event loop: use `await arun(...)` there)."""
        _no_running_loop("run")
        return self.run_sync(self.arun(tasks, n=n, mode=mode, metadata=metadata))

    def run_sync(self, coro: Awaitable[Any]) -> Any:
        """Run a coroutine on the controller's own event loop, kept across calls so async
        clients an agent caches stay usable; if that loop is busy (continuous mode in
        another thread), on a fresh one."""
        if self._loop_lock.acquire(blocking=False):
            try:
                if self._loop is None or self._loop.is_closed():
                    self._loop = asyncio.new_event_loop()
                return self._loop.run_until_complete(coro)
            finally:
                self._loop_lock.release()
        return asyncio.run(coro)  # type: ignore[arg-type]

    # -- continuous mode ---------------------------------------------------------
    async def arun_continuous(self, tasks: Any, *, n: int, groups_in_flight: int = 4, max_groups: int | None = None,
                              shuffle: bool = False, seed: int | None = None,
                              on_group: Callable[[list[RolloutResult]], Any] | None = None) -> ControllerStats:
        """Keep `groups_in_flight` groups running, cycling through the tasks, until `stop()`
        or `max_groups` groups finished. Pausing holds new rollouts (and groups) back.
        `on_group(results)` is called (sync or async) as each group completes."""
        pairs = load_tasks(tasks, task_id_key=self.task_id_key)
        if not pairs:
            raise ValueError("no tasks")
        rng = random.Random(seed)
        self._stopping = False
        await self._enter_session()
        active: set[asyncio.Task[list[RolloutResult]]] = set()
        started = 0
        epoch = 0

        def order() -> list[tuple[str, dict[str, Any]]]:
            items = list(pairs)
            if shuffle:
                rng.shuffle(items)
            return items

        queue = order()
        try:
            while not self._stopping and (max_groups is None or started < max_groups):
                if len(active) >= groups_in_flight or self._paused:
                    done, active = await _wait_some(active, 0.05)
                    await _report(done, on_group)
                    continue
                if not queue:
                    epoch += 1
                    queue = order()
                tid, task = queue.pop(0)
                active.add(asyncio.ensure_future(self._group(tid, task, n, Mode.TRAIN.value, {"epoch": epoch})))
                started += 1
            while active:
                done, active = await _wait_some(active, None)
                await _report(done, on_group)
        finally:
            for t in active:
                t.cancel()
            await self._exit_session()
        return self.stats

    def run_continuous(self, tasks: Any, **kwargs: Any) -> ControllerStats:
        _no_running_loop("run_continuous")
        return self.run_sync(self.arun_continuous(tasks, **kwargs))

    def start_continuous(self, tasks: Any, **kwargs: Any) -> threading.Thread:
        """`run_continuous` in a background thread; end it with `stop()` then `thread.join()`.
        The trainer (sync mode) calls `drain()` before an update and `resume()` after."""
        t = threading.Thread(target=self.run_continuous, args=(tasks,), kwargs=kwargs, daemon=True,
                             name="rollout-controller")
        t.start()
        return t


async def _wait_some(active: set[asyncio.Task[Any]], timeout: float | None
                     ) -> tuple[set[asyncio.Task[Any]], set[asyncio.Task[Any]]]:
    if not active:
        await asyncio.sleep(timeout or 0)
        return set(), active
    done, pending = await asyncio.wait(active, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    return done, pending


async def _report(done: set[asyncio.Task[Any]], on_group: Callable[[Any], Any] | None) -> None:
    for t in done:
        results = t.result()
        if on_group is not None:
            out = on_group(results)
            if inspect.isawaitable(out):
                await out


def _no_running_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"RolloutController.{name}() blocks; inside an event loop use `await a{name}(...)`")


def reap_stale(store: TraceStore | str | None, older_than: float, *, include_unleased: bool = False) -> list[str]:
    """End running rollouts with no heartbeat for `older_than` seconds as failed; returns their ids."""
    return get_store(store).reap_stale(older_than, include_unleased=include_unleased)


def run_rollouts(agent: AgentFn | str, tasks: Any, *, n: int = 1, **controller_kwargs: Any) -> list[RolloutResult]:
    """One-shot convenience: build a controller, run the tasks, close it."""
    mode = controller_kwargs.pop("mode", Mode.TRAIN.value)
    with RolloutController(agent, **controller_kwargs) as c:
        return c.run(tasks, n=n, mode=mode)


# --------------------------------------------------------------------------
# CLI: lightning-mw rollouts ...
# --------------------------------------------------------------------------

def add_cli(sub: Any) -> None:
    p = sub.add_parser("rollouts", help="run an agent over a task set, evaluate, reap stale rollouts")
    cmds = p.add_subparsers(dest="rollouts_command", metavar="ACTION")

    def common(q: Any) -> None:
        q.add_argument("--agent", required=True, help="the agent function, as package.module:function")
        q.add_argument("--tasks", required=True, help="JSONL file, one task (a JSON object) per line")
        q.add_argument("--store", default=None, help="store URL (default: env LIGHTNING_STORE_URL or ./lightning_traces.db)")
        q.add_argument("--backend", default="auto", choices=["auto", "asyncio", "thread", "process", "ray"])
        q.add_argument("--concurrency", type=int, default=8)
        q.add_argument("--timeout", type=float, default=None, help="per-rollout timeout, seconds")
        q.add_argument("--retries", type=int, default=2, help="extra attempts after an infrastructure error")
        q.add_argument("--workers", type=int, default=None, help="worker processes / Ray actors")
        q.add_argument("--ray-address", default=None, help="existing Ray cluster (default: start a local runtime)")

    r = cmds.add_parser("run", help="n samples per task (mode train or val)")
    common(r)
    r.add_argument("-n", type=int, default=1, help="samples per task (the GRPO group size)")
    r.add_argument("--mode", default="train", choices=["train", "val"])
    r.set_defaults(func=_cli_run)

    e = cmds.add_parser("eval", help="mode=val rollouts on a held-out task set; metrics stored and shown")
    common(e)
    e.add_argument("-n", type=int, default=1)
    e.add_argument("--step", type=int, default=None, help="training step this evaluation belongs to")
    e.add_argument("--name", default="val")
    e.add_argument("--success-threshold", type=float, default=1.0)
    e.set_defaults(func=_cli_eval)

    m = cmds.add_parser("metrics", help="show stored evaluation results")
    m.add_argument("--store", default=None)
    m.add_argument("--name", default=None)
    m.set_defaults(func=_cli_metrics)

    k = cmds.add_parser("reap", help="end running rollouts whose lease heartbeat is older than --older-than")
    k.add_argument("--store", default=None)
    k.add_argument("--older-than", type=float, default=300.0, help="seconds")
    k.add_argument("--include-unleased", action="store_true",
                   help="also end running rollouts without a lease created before the cutoff")
    k.set_defaults(func=_cli_reap)
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])


def _controller_from(args: Any) -> RolloutController:
    sys.path.insert(0, os.getcwd())
    return RolloutController(args.agent, store=args.store, backend=args.backend, concurrency=args.concurrency,
                             timeout_s=args.timeout, retry=RetryPolicy(max_attempts=1 + max(0, args.retries)),
                             workers=args.workers, ray_address=args.ray_address)


def _cli_run(args: Any) -> int:
    t0 = time.monotonic()
    with _controller_from(args) as c:
        results = c.run(args.tasks, n=args.n, mode=args.mode)
    wall = time.monotonic() - t0
    by: dict[str, int] = {}
    for res in results:
        by[res.status] = by.get(res.status, 0) + 1
    rewards = [res.reward for res in results if res.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    print(f"{len(results)} rollouts in {wall:.1f}s ({len(results) / max(wall, 1e-9):.1f}/s): "
          + ", ".join(f"{k}={v}" for k, v in sorted(by.items()))
          + f"; mean reward {mean:.3f}; retried {c.stats.retried}; max in flight {c.stats.max_in_flight}")
    return 0 if by.get("succeeded", 0) == len(results) else 1


def _cli_eval(args: Any) -> int:
    from .evaluation import Evaluator, format_metrics

    with _controller_from(args) as c:
        ev = Evaluator(c, args.tasks, n=args.n, name=args.name, success_threshold=args.success_threshold)
        result = ev.evaluate(step=args.step)
    print(format_metrics(result.metrics))
    return 0


def _cli_metrics(args: Any) -> int:
    from .evaluation import format_history

    print(format_history(get_store(args.store).eval_results(args.name)))
    return 0


def _cli_reap(args: Any) -> int:
    ended = reap_stale(args.store, args.older_than, include_unleased=args.include_unleased)
    print(f"ended {len(ended)} stale rollouts" + (": " + ", ".join(ended) if ended else ""))
    return 0
