"""Running one rollout job: the agent inside `rollout(...)`, its return value as the reward,
timeouts, and an outcome that never raises for an agent error. Every backend calls these, in
whatever process runs the job."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from lightning_middleware.capture import RolloutHandle, rollout
from lightning_middleware.controller.jobs import BREACHES, RolloutJob, RolloutOutcome, SandboxBreach, type_names
from lightning_middleware.controller.sandbox_entry import ENV_SANDBOX, ENV_SANDBOX_WORKSPACE, classify
from lightning_middleware.errors import UsageError
from lightning_middleware.records import RolloutStatus
from lightning_middleware.store import TraceStore, get_store

AgentFn = Callable[[dict[str, Any]], Any]


class _Deadline(BaseException):
    """Raised by SIGALRM in a worker's main thread; BaseException so HTTP stacks don't swallow it."""


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


def failure(exc: BaseException, t0: float, worker: str | None) -> RolloutOutcome:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    status = RolloutStatus.TIMEOUT.value if isinstance(exc, TimeoutError) else RolloutStatus.FAILED.value
    breach = _breach(exc)
    if breach is not None:  # a sandboxed pod's rollout: failed with its class, never retried
        return RolloutOutcome(status=RolloutStatus.FAILED.value, error=f"{breach.kind}: {text}",
                              error_types=tuple(type_names(breach)), duration_s=time.monotonic() - t0, worker=worker)
    return RolloutOutcome(status=status, error=text, error_types=tuple(type_names(type(exc))),
                          duration_s=time.monotonic() - t0, worker=worker)


def _breach(exc: BaseException) -> type[SandboxBreach] | None:
    """In a rollout the Kubernetes pod template sandboxes (LIGHTNING_SANDBOX=1), the breach an error
    stands for, by the rule the local sandbox applies inside (sandbox_entry.classify)."""
    if os.environ.get(ENV_SANDBOX) != "1":
        return None
    kind = classify(exc, os.environ.get(ENV_SANDBOX_WORKSPACE, "/workspace"))
    return None if kind is None else BREACHES[kind]


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _final_reward(store: TraceStore, rollout_id: str) -> float | None:
    found = store.get_rollout(rollout_id)
    return None if found is None else found.final_reward


def _scope(job: RolloutJob, store: TraceStore) -> Any:
    return rollout(job.task_id, input=job.task, mode=job.mode, metadata=job.metadata, store=store,
                   rollout_id=job.rollout_id, policy_version=job.policy_version, rewards=job.rewards)


@contextlib.contextmanager
def _alarm(timeout_s: float | None) -> Iterator[None]:
    """A TimeoutError at `timeout_s`, by SIGALRM, when this is a process's main thread (worker
    processes); elsewhere (a thread pool) nothing: the agent can't be interrupted there."""
    if timeout_s is None or not hasattr(signal, "setitimer") \
            or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _on_alarm(_sig: int, _frame: Any) -> None:
        raise _Deadline()

    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    except _Deadline:
        raise TimeoutError(f"rollout exceeded its {timeout_s:g}s timeout") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


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
    reward: float | None = None
    try:
        with _scope(job, store) as handle:
            with _alarm(job.timeout_s):
                value = agent(job.task)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout")
            reward = _apply_return(handle, value)
    except _Deadline:  # the alarm fired between the agent's return and disarming
        return failure(TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout"), t0, worker_name())
    except Exception as exc:
        return failure(exc, t0, worker_name())
    if reward is None or job.rewards is not None:  # configured: the combination, not the agent's number
        reward = _final_reward(store, job.rollout_id)
    return RolloutOutcome(status=RolloutStatus.SUCCEEDED.value, reward=reward,
                          duration_s=time.monotonic() - t0, worker=worker_name())


class _Returned:
    """Where `_apply_return` puts the reward when no store records the rollout."""

    def reward(self, value: float, metadata: dict[str, Any] | None = None) -> None:
        float(value)  # the agent's number must be one, as a recorded rollout's must


def execute_unrecorded(agent: AgentFn, job: RolloutJob) -> RolloutOutcome:
    """Run the agent for one job without a store: a rollout that the gateway it reaches records
    (a pod that holds no store URL, only its rollout's gateway route and token). The outcome's
    reward is the number the agent returned, not stored: its backend posts it to the gateway."""
    t0 = time.monotonic()
    try:
        if inspect.iscoroutinefunction(agent):
            value = asyncio.run(_unrecorded_async(agent, job, t0))
        else:
            with _alarm(job.timeout_s):
                value = agent(job.task)
        reward = _apply_return(cast(RolloutHandle, _Returned()), value)
    except _Deadline:
        return failure(TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout"), t0, worker_name())
    except Exception as exc:
        return failure(exc, t0, worker_name())
    return RolloutOutcome(status=RolloutStatus.SUCCEEDED.value, reward=reward,
                          duration_s=time.monotonic() - t0, worker=worker_name())


async def _unrecorded_async(agent: AgentFn, job: RolloutJob, t0: float) -> Any:
    try:
        return await asyncio.wait_for(agent(job.task), job.timeout_s)
    except asyncio.TimeoutError:
        if time.monotonic() - t0 >= (job.timeout_s or 0.0):
            raise TimeoutError(f"rollout exceeded its {job.timeout_s:g}s timeout") from None
        raise


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
        return failure(exc, t0, worker_name())
    if reward is None or job.rewards is not None:
        reward = await asyncio.to_thread(_final_reward, store, job.rollout_id)
    return RolloutOutcome(status=RolloutStatus.SUCCEEDED.value, reward=reward,
                          duration_s=time.monotonic() - t0, worker=worker_name())


class AgentNotFound(UsageError, ValueError):
    """The agent "module:function" cannot be imported."""


def resolve_agent(agent: AgentFn | str) -> AgentFn:
    """An agent function, or "package.module:function"."""
    if callable(agent):
        return agent
    if not isinstance(agent, str) or ":" not in agent:
        raise AgentNotFound(f"agent must be a callable or 'module:function', got {agent!r}")
    mod, _, name = agent.partition(":")
    try:
        fn: Any = importlib.import_module(mod)
        for part in name.split("."):
            fn = getattr(fn, part)
    except ImportError as exc:
        raise AgentNotFound(f"cannot import the agent {agent!r}: {exc}") from None
    except AttributeError:
        raise AgentNotFound(f"cannot import the agent {agent!r}: module {mod!r} has no {name!r}") from None
    if not callable(fn):
        raise AgentNotFound(f"the agent {agent!r} is not callable")
    return fn


def no_running_loop(name: str) -> None:
    """Refuse a blocking call from inside a running event loop, naming its async twin."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"RolloutController.{name}() blocks; inside an event loop use `await a{name}(...)`")
