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
fails only its rollout), "ray" (actors on a Ray cluster), "k8s" (a Job per rollout,
`k8s_template=PodTemplate(...)`; several per Job: `backend=KubernetesBackend(..., rollouts_per_job=N)`).
Ray and the kubernetes client are imported only when their backend starts.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from lightning_middleware.controller.backends import Backend, PodTemplate, make_backend
from lightning_middleware.controller.execution import AgentFn, failure, no_running_loop, resolve_agent, worker_name
from lightning_middleware.controller.jobs import ControllerStats, RetryPolicy, RolloutJob, RolloutOutcome, RolloutResult
from lightning_middleware.controller.settling import cancel_and_wait, finish_despite_cancellation, gather_settled
from lightning_middleware.controller.tasks import TaskSource, load_tasks, task_timeout
from lightning_middleware.records import Mode, Rollout, RolloutStatus
from lightning_middleware.rewards import RewardConfig, Scorer, load_config
from lightning_middleware.store import TraceStore, get_store

log = logging.getLogger(__name__)

T = TypeVar("T")
OnGroup = Callable[[list[RolloutResult]], Any]  # sync, or async (awaited)


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
                 timeout_key: str | None = "timeout_s", workers: int | None = None, ray_address: str | None = None,
                 k8s_template: PodTemplate | None = None,
                 rewards: RewardConfig | str | None = None) -> None:
        """`rewards`: a reward configuration (or its file) each rollout is scored under as it ends
        (docs/rewards.md); `RolloutResult.reward` is then the combined final reward. `k8s_template`:
        the pod template of backend="k8s" (docs/kubernetes.md). `timeout_s`: each rollout's timeout, unless
        its task names its own under `timeout_key` (None: tasks cannot)."""
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.agent_ref = agent
        self.agent = resolve_agent(agent)
        self.store = get_store(store)
        self.backend = make_backend(backend, self.agent, concurrency=concurrency, workers=workers,
                                    ray_address=ray_address, k8s_template=k8s_template)
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.policy_version = policy_version
        self.policy_version_ttl_s = policy_version_ttl_s
        self.lease_s = lease_s
        self.reap = reap
        self.metadata = dict(metadata or {})
        self.task_id_key = task_id_key
        self.timeout_key = timeout_key
        # A file by its absolute path (a worker may run elsewhere); checked here, not in every job.
        self.rewards = rewards if rewards is None or isinstance(rewards, RewardConfig) else os.path.abspath(rewards)
        if self.rewards is not None:
            Scorer(self.rewards if isinstance(self.rewards, RewardConfig) else load_config(self.rewards))
        self.owner = f"{worker_name()}:{uuid.uuid4().hex[:6]}"
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
        self._runner: asyncio.Runner | None = None
        self._runner_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------
    def _start_backend(self) -> None:
        if not self._started:
            agent: Any = self.agent_ref if self.backend.out_of_process else self.agent
            self.backend.start(agent, self.store)
            self._started = True

    def close(self) -> None:
        """Stop the backend (worker processes, Ray actors). The controller can't be reused after."""
        self.backend.close()
        self._started = False
        if self._runner is not None and self._runner_lock.acquire(blocking=False):
            try:
                self._runner.close()
                self._runner = None
            finally:
                self._runner_lock.release()

    def __enter__(self) -> RolloutController:
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
                await finish_despite_cancellation(asyncio.to_thread(self._end_in_store, job, outcome))
                raise
            except Exception as exc:  # a backend bug or an unreachable cluster: fail this rollout
                log.exception("backend %s failed on rollout %s", self.backend.name, job.rollout_id)
                outcome = replace(failure(exc, time.monotonic(), None), ended_by_controller=True)
            if outcome.ended_by_controller:
                outcome = await asyncio.to_thread(self._end_in_store, job, outcome)
            return outcome
        finally:
            with self._idle:
                self._in_flight.pop(job.rollout_id, None)
                self._released.add(job.rollout_id)
                self.stats.in_flight = len(self._in_flight)
                self.stats.finished += 1
                self._idle.notify_all()

    def _end_in_store(self, job: RolloutJob, outcome: RolloutOutcome) -> RolloutOutcome:
        """End a rollout its own process could not end; the outcome to report. A worker can die
        after it ended its rollout and before its outcome reached us (an OOM kill in its teardown):
        a rollout the store has as succeeded is whole, and retrying it would sample its task twice."""
        if not self.backend.out_of_process:
            self.store.flush(5.0)  # same process: let the row land first
        template = Rollout(id=job.rollout_id, task_id=job.task_id, mode=Mode(job.mode), input=job.task,
                           metadata=job.metadata, policy_version=job.policy_version,
                           created_at=job.created_at or time.time())
        if self.store.end_rollout_if_running(template, status=outcome.status, error=outcome.error):
            return outcome
        stored = self.store.get_rollout(job.rollout_id)
        if stored is None or stored.status != RolloutStatus.SUCCEEDED:
            return outcome
        log.warning("the %s worker of rollout %s failed after the rollout succeeded (%s); its outcome is kept",
                    self.backend.name, job.rollout_id, outcome.error)
        return RolloutOutcome(status=stored.status.value, reward=stored.final_reward,
                              duration_s=stored.duration_s or outcome.duration_s, worker=outcome.worker)

    async def _sample(self, task_id: str, task: dict[str, Any], index: int, mode: str,
                      extra: dict[str, Any] | None = None) -> RolloutResult:
        assert self._sem is not None
        ids: list[str] = []
        attempt = 0
        while True:
            attempt += 1
            async with self._sem:
                while self._paused:
                    self.stats.held_by_pause += 1
                    await asyncio.sleep(0.02)
                pv = await self._current_policy_version()
                meta = {**self.metadata, **(extra or {}), "sample_index": index, "attempt": attempt}
                if ids:
                    meta["retry_of"] = ids[-1]
                job = RolloutJob(rollout_id=uuid.uuid4().hex, task_id=task_id, task=task, sample_index=index,
                                 attempt=attempt, mode=mode, policy_version=pv, metadata=meta,
                                 store_url=self.store.url.render_as_string(hide_password=False),
                                 timeout_s=task_timeout(task, self.timeout_key, self.timeout_s),
                                 created_at=time.time(), rewards=self.rewards)
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
        results = await gather_settled(self._sample(task_id, task, i, mode, extra) for i in range(n))
        with self._lock:
            self.stats.groups_finished += 1
        return list(results)

    # -- batch mode --------------------------------------------------------------
    async def arun(self, tasks: TaskSource, *, n: int = 1, mode: str = Mode.TRAIN.value,
                   metadata: dict[str, Any] | None = None) -> list[RolloutResult]:
        """Run n samples of every task (each task one group); results in task, sample order."""
        if n < 1:
            raise ValueError("n must be >= 1")
        pairs = load_tasks(tasks, task_id_key=self.task_id_key, timeout_key=self.timeout_key)
        await self._enter_session()
        try:
            groups = await gather_settled(self._group(tid, task, n, mode, metadata) for tid, task in pairs)
        finally:
            await self._exit_session()
        return [r for g in groups for r in g]

    def run(self, tasks: TaskSource, *, n: int = 1, mode: str = Mode.TRAIN.value,
            metadata: dict[str, Any] | None = None) -> list[RolloutResult]:
        """Blocking `arun` (not from inside a running event loop: use `await arun(...)` there)."""
        no_running_loop("run")
        return self.run_sync(self.arun(tasks, n=n, mode=mode, metadata=metadata))

    def run_sync(self, coro: Awaitable[T]) -> T:
        """Run a coroutine on the controller's own event loop (an `asyncio.Runner`), kept across
        calls so async clients an agent caches stay usable; if that loop is busy (continuous mode
        in another thread), on a fresh one. Ctrl-C, as in `asyncio.run`, cancels the run, which
        records the end of every rollout it started, then raises KeyboardInterrupt: rollouts the
        user interrupted are not left running, nor recorded as finished by the agents' late ends."""
        if self._runner_lock.acquire(blocking=False):
            try:
                if self._runner is None:
                    self._runner = asyncio.Runner()
                return self._runner.run(coro)  # type: ignore[arg-type]
            finally:
                self._runner_lock.release()
        return asyncio.run(coro)  # type: ignore[arg-type]

    # -- continuous mode ---------------------------------------------------------
    async def arun_continuous(self, tasks: TaskSource, *, n: int, groups_in_flight: int = 4,
                              max_groups: int | None = None, shuffle: bool = False, seed: int | None = None,
                              on_group: OnGroup | None = None, sit_out_uniform: float = 0.0) -> ControllerStats:
        """Keep `groups_in_flight` groups running, cycling through the tasks, until `stop()`
        or `max_groups` groups finished. Pausing holds new rollouts (and groups) back.
        `on_group(results)` is called (sync or async) as each group completes.

        `sit_out_uniform`: the chance that a task whose latest group came back uniform (every sample
        the same reward: no signal for a group-relative advantage, and the trainer skips it) sits
        out its next turn. 1.0 drops such a task until it is drawn in an epoch where every task
        would sit out (which then runs them all); 0 (the default) samples every task every epoch.
        """
        pairs = load_tasks(tasks, task_id_key=self.task_id_key, timeout_key=self.timeout_key)
        if not pairs:
            raise ValueError("no tasks")
        if not 0.0 <= sit_out_uniform <= 1.0:
            raise ValueError(f"sit_out_uniform is a probability in [0, 1], not {sit_out_uniform!r}")
        rng = random.Random(seed)
        uniform: set[str] = set()  # tasks whose latest finished group had one reward
        started_in_epoch = 0
        sit_out_this_epoch = sit_out_uniform > 0
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
                    _note_uniform(done, uniform)
                    await _report(done, on_group)
                    continue
                if not queue:
                    epoch += 1
                    queue = order()
                    # an epoch where every task sat out runs the next one whole (no busy loop)
                    sit_out_this_epoch = sit_out_uniform > 0 and started_in_epoch > 0
                    if sit_out_uniform > 0 and not sit_out_this_epoch:
                        log.info("every task sat out epoch %d as uniform; epoch %d samples them all", epoch - 1, epoch)
                    started_in_epoch = 0
                tid, task = queue.pop(0)
                if sit_out_this_epoch and tid in uniform and rng.random() < sit_out_uniform:
                    with self._lock:
                        self.stats.groups_sat_out_uniform += 1
                    continue
                active.add(asyncio.ensure_future(self._group(tid, task, n, Mode.TRAIN.value, {"epoch": epoch})))
                started += 1
                started_in_epoch += 1
            while active:
                done, active = await _wait_some(active, None)
                _note_uniform(done, uniform)
                await _report(done, on_group)
        finally:
            await cancel_and_wait(active)
            await self._exit_session()
        return self.stats

    def run_continuous(self, tasks: TaskSource, *, n: int, groups_in_flight: int = 4, max_groups: int | None = None,
                       shuffle: bool = False, seed: int | None = None,
                       on_group: OnGroup | None = None, sit_out_uniform: float = 0.0) -> ControllerStats:
        """Blocking `arun_continuous`."""
        no_running_loop("run_continuous")
        return self.run_sync(self.arun_continuous(tasks, n=n, groups_in_flight=groups_in_flight, max_groups=max_groups,
                                                  shuffle=shuffle, seed=seed, on_group=on_group,
                                                  sit_out_uniform=sit_out_uniform))

    def start_continuous(self, tasks: TaskSource, **kwargs: Any) -> threading.Thread:
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


def _note_uniform(done: set[asyncio.Task[list[RolloutResult]]], uniform: set[str]) -> None:
    """Mark each finished group's task uniform (two or more succeeded samples, every reward known and
    equal) or not. A group with a reward still pending (a ranking judge scores it later) is not."""
    for t in done:
        results = t.result()
        if not results:
            continue
        rewards = [r.reward for r in results if r.status == RolloutStatus.SUCCEEDED.value]
        if len(rewards) >= 2 and None not in rewards and len(set(rewards)) == 1:
            uniform.add(results[0].task_id)
        else:
            uniform.discard(results[0].task_id)


async def _report(done: set[asyncio.Task[Any]], on_group: OnGroup | None) -> None:
    for t in done:
        results = t.result()
        if on_group is not None:
            out = on_group(results)
            if inspect.isawaitable(out):
                await out


def reap_stale(store: TraceStore | str | None, older_than: float, *, include_unleased: bool = False) -> list[str]:
    """End running rollouts with no heartbeat for `older_than` seconds as failed; returns their ids."""
    return get_store(store).reap_stale(older_than, include_unleased=include_unleased)


def run_rollouts(agent: AgentFn | str, tasks: TaskSource, *, n: int = 1,
                 **controller_kwargs: Any) -> list[RolloutResult]:
    """One-shot convenience: build a controller, run the tasks, close it."""
    mode = controller_kwargs.pop("mode", Mode.TRAIN.value)
    with RolloutController(agent, **controller_kwargs) as c:
        return c.run(tasks, n=n, mode=mode)
