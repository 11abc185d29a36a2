"""Rollout context: which rollout an LLM call belongs to.

The current rollout lives in a ContextVar. Its state object is shared (not
copied) by every asyncio task started inside the block, and holds a locked call
counter, so `call_index` stays unique and in issue order across
`asyncio.gather` children. Threads don't inherit ContextVars: use
`propagate(fn)` (or a framework that copies the context, as LangChain does), or
send the `x-rollout-id` header (see `rollout_headers()`), which the capture
transport reads and removes before the request leaves the process.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lightning_middleware.capture.exact_history import SampledTurns
from lightning_middleware.records import Mode, Reward, Rollout, RolloutStatus, new_id
from lightning_middleware.rewards import RewardConfig, Scorer, load_config
from lightning_middleware.rewards.config import AGENT
from lightning_middleware.store import TraceStore, get_store

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

ROLLOUT_HEADER = "x-rollout-id"
AGENT_HEADER = "x-agent-name"


class RolloutState:
    """The mutable part of a rollout that its LLM calls share (internal)."""

    def __init__(self, rollout_id: str, task_id: str | None, mode: str, store: TraceStore,
                 policy_version: int | None = None, scorer: Scorer | None = None) -> None:
        self.id = rollout_id
        self.task_id = task_id
        self.mode = mode
        self.store = store
        self.policy_version = policy_version
        self.scorer = scorer  # the reward configuration scored at the rollout's end, if any
        # The rollout's own agent -> served model map (a gateway rollout's `policies`), consulted
        # before the client's or gateway's map; `default_policy` before theirs (docs/policies.md).
        self.policies: Mapping[str, str] = {}
        self.default_policy: str | None = None
        self.ended = False
        self.last_call_index: int | None = None
        self.sampled_turns = SampledTurns()  # for wrap(exact_history=True): capture/exact_history.py
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def next_call_index(self) -> int:
        with self._lock:
            self.last_call_index = next(self._counter)
            return self.last_call_index

    def continue_from(self, index: int) -> None:
        """Number the next call `index` (a rollout reopened after a restart keeps its numbering)."""
        with self._lock:
            self._counter = itertools.count(index)


_current: contextvars.ContextVar[RolloutState | None] = contextvars.ContextVar("lightning_rollout", default=None)
_agent: contextvars.ContextVar[str | None] = contextvars.ContextVar("lightning_agent", default=None)

# Rollouts open in this process, so a call that only carries the header still
# gets the right counter and store.
_active: dict[str, RolloutState] = {}
_active_lock = threading.Lock()


def current_rollout() -> RolloutState | None:
    return _current.get()


def current_agent() -> str | None:
    return _agent.get()


def set_current_agent(name: str | None) -> None:
    """Name the agent for the calls made in this context from now on. For framework hooks that
    see a start and an end event rather than a block; elsewhere use `agent_scope`."""
    _agent.set(name)


def state_for_header(rollout_id: str, fallback_store: TraceStore) -> RolloutState:
    """The state of a rollout addressed by header; created if it was opened elsewhere."""
    with _active_lock:
        state = _active.get(rollout_id)
        if state is None:
            # Opened in another process (or already closed here): count from 0 in
            # this process. Calls still sort by started_at within an index.
            state = _active[rollout_id] = RolloutState(rollout_id, None, Mode.TRAIN.value, fallback_store)
        return state


def rollout_headers() -> dict[str, str]:
    """Headers that attach a call to the current rollout from outside its context."""
    state = _current.get()
    return {} if state is None else {ROLLOUT_HEADER: state.id}


def _checked_value(value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"reward must be a number, got {value!r}") from None
    if value != value:  # NaN would poison a whole GRPO group
        raise ValueError("reward is NaN")
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"reward must be a finite number, got {value}")
    return float(value)


def _checked_agent(agent: Any) -> str | None:
    if agent is not None and (not isinstance(agent, str) or not agent.strip() or len(agent) > 128):
        raise ValueError(f"agent must be an agent's name (a non-empty string of at most 128 characters), got {agent!r}")
    return agent


def record_reward(state: RolloutState, value: Any, *, name: str | None = None, final: bool | None = None,
                  metadata: dict[str, Any] | None = None, call_index: int | None = None,
                  agent: str | None = None) -> None:
    """`RolloutHandle.reward` for any holder of a rollout's state (see there)."""
    value = _checked_value(value)
    agent = _checked_agent(agent)
    if call_index is not None and (isinstance(call_index, bool) or not isinstance(call_index, int)
                                   or call_index < 0):
        raise ValueError(f"call_index must be a call's index (an int >= 0), got {call_index!r}")
    if call_index is not None and final:
        raise ValueError("a per-step reward (call_index) cannot be final")
    meta = dict(metadata or {})
    if state.ended:
        meta["late"] = True
    final = call_index is None if final is None else final
    if state.scorer is not None and call_index is None and agent is None:
        name, final = name or AGENT, False  # an input of the configured components
    reward = Reward(rollout_id=state.id, value=value, name=name, final=final, created_at=time.time(),
                    metadata=meta, call_index=call_index, agent=agent)
    if not state.ended or state.scorer is None or agent is not None:  # a per-agent reward is no component
        state.store.submit_reward(reward)  # late: the store's rule decides whether it moves final_reward
    else:
        state.store.add_reward(reward)
        _score(state, None)  # late: combine again with it (the reward model is not asked again)


def _score(state: RolloutState, status: str | None) -> None:
    """Score the rollout under its configuration; a failure is logged, never raised into the agent."""
    assert state.scorer is not None
    try:
        if not state.store.flush(30.0):
            log.warning("rollout %s: its calls are not all in the store; scoring what is there", state.id)
        state.scorer.score_rollout(state.store, state.id, status=status, reuse_model=status is None)
    except Exception:  # noqa: BLE001 - a broken store or rule must not fail the agent's run
        log.exception("rollout %s could not be scored under reward configuration %s", state.id, state.scorer.hash)


def _scorer(rewards: RewardConfig | Scorer | str | os.PathLike[str] | None) -> Scorer | None:
    if rewards is None or isinstance(rewards, Scorer):
        return rewards
    return Scorer(rewards if isinstance(rewards, RewardConfig) else load_config(rewards))


class RolloutHandle:
    """What `with rollout(...) as r` gives: the rollout's id and a way to reward it."""

    def __init__(self, state: RolloutState) -> None:
        self._state = state

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def task_id(self) -> str | None:
        return self._state.task_id

    @property
    def last_call_index(self) -> int | None:
        """The index of the rollout's latest LLM call (None before the first): for a per-step reward."""
        return self._state.last_call_index

    def reward(self, value: float, *, name: str | None = None, final: bool | None = None,
               metadata: dict[str, Any] | None = None, call_index: int | None = None,
               agent: str | None = None) -> None:
        """Record a reward; a final one (the default) becomes the rollout's training reward.

        `call_index` ties it to one call (a per-step reward, never final). With a reward
        configuration (`rollout(..., rewards=...)`) the agent's reward is one input of the
        configured components (stored as "agent" unless named) and the combination is final.
        A reward after the rollout ended is kept, marked `late` (docs/rewards.md has the rule).
        `agent` rewards one agent of a multi-agent rollout (`TraceStore.agent_rewards`); it never
        moves the rollout's final reward, nor is it a configured component.
        """
        record_reward(self._state, value, name=name, final=final, metadata=metadata, call_index=call_index,
                      agent=agent)

    def __repr__(self) -> str:
        return f"RolloutHandle(id={self.id!r}, task_id={self.task_id!r})"


class _RolloutScope:
    """`rollout(...)`: a context manager (sync and async) and a decorator."""

    def __init__(self, task_id: str, *, input: Any, mode: str, metadata: dict[str, Any] | None,
                 store: TraceStore | str | None, rollout_id: str | None, policy_version: int | None,
                 flush_timeout: float, rewards: RewardConfig | Scorer | str | os.PathLike[str] | None = None) -> None:
        if mode not in (Mode.TRAIN.value, Mode.VAL.value):
            raise ValueError(f"mode must be 'train' or 'val', got {mode!r}")
        if not isinstance(task_id, str) or not task_id:
            raise ValueError(f"task_id must be a non-empty string, got {task_id!r}")
        self._args = dict(task_id=task_id, input=input, mode=mode, metadata=metadata, store=store,
                          rollout_id=rollout_id, policy_version=policy_version, flush_timeout=flush_timeout,
                          rewards=_scorer(rewards))  # a bad configuration fails here, not at the end
        self._frames: list[tuple[RolloutState, contextvars.Token[RolloutState | None], float]] = []

    # -- context manager -----------------------------------------------------
    def __enter__(self) -> RolloutHandle:
        a = self._args
        store = get_store(a["store"])
        state = RolloutState(a["rollout_id"] or new_id(), a["task_id"], a["mode"], store,
                             a["policy_version"], a["rewards"])
        started = time.time()
        store.submit_rollout(Rollout(
            id=state.id, task_id=a["task_id"], mode=Mode(a["mode"]), status=RolloutStatus.RUNNING,
            input=a["input"], metadata=a["metadata"] or {}, policy_version=a["policy_version"],
            created_at=started,
        ))
        with _active_lock:
            _active[state.id] = state
        self._frames.append((state, _current.set(state), time.monotonic()))
        return RolloutHandle(state)

    def _leave(self, exc_type: type[BaseException] | None,
               exc: BaseException | None) -> tuple[RolloutState, str, str | None, float]:
        """Restore the outer context; the rollout's (state, status, error, start) for `_end`."""
        state, token, t0 = self._frames.pop()
        _current.reset(token)
        with _active_lock:
            _active.pop(state.id, None)
        status, error = _outcome(exc_type, exc)
        return state, status, error, t0

    @staticmethod
    def _end(state: RolloutState, status: str, error: str | None, t0: float) -> RolloutState:
        """Score the rollout (with a reward configuration: its final reward is in before it shows
        as ended) and submit its end; the caller flushes."""
        if state.scorer is not None:
            _score(state, status)
        state.store.submit_rollout_end(state.id, status=status, ended_at=time.time(),
                                       duration_s=time.monotonic() - t0, error=error)
        state.ended = True
        return state

    @staticmethod
    def _warn_unflushed(state: RolloutState, ok: bool) -> None:
        if not ok:
            log.warning("rollout %s ended but its traces are not on disk yet (store unavailable?)", state.id)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: Any) -> None:
        state = self._end(*self._leave(exc_type, exc))
        self._warn_unflushed(state, state.store.flush(self._args["flush_timeout"]))

    async def __aenter__(self) -> RolloutHandle:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: Any) -> None:
        left = self._leave(exc_type, exc)
        # Scoring and flush() may wait on the store, a judge: keep the event loop free meanwhile.
        state = await asyncio.to_thread(self._end, *left) if left[0].scorer is not None else self._end(*left)
        self._warn_unflushed(state, await asyncio.to_thread(state.store.flush, self._args["flush_timeout"]))

    # -- decorator -----------------------------------------------------------
    def __call__(self, fn: F) -> F:
        args = self._args
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*a: Any, **kw: Any) -> Any:
                async with _RolloutScope(**args):
                    return await fn(*a, **kw)
            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with _RolloutScope(**args):
                return fn(*a, **kw)
        return wrapper  # type: ignore[return-value]


def _outcome(exc_type: type[BaseException] | None, exc: BaseException | None) -> tuple[str, str | None]:
    if exc_type is None:
        return RolloutStatus.SUCCEEDED.value, None
    text = f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__
    if issubclass(exc_type, (TimeoutError, asyncio.TimeoutError)):
        return RolloutStatus.TIMEOUT.value, text
    return RolloutStatus.FAILED.value, text


def rollout(task_id: str, *, input: Any = None, mode: str = "train", metadata: dict[str, Any] | None = None,
            store: TraceStore | str | None = None, rollout_id: str | None = None,
            policy_version: int | None = None, flush_timeout: float = 10.0,
            rewards: RewardConfig | Scorer | str | os.PathLike[str] | None = None) -> _RolloutScope:
    """Open a rollout of `task_id`: every LLM call made inside is recorded under it.

    Use as `with rollout("task-7") as r:`, `async with ...`, or `@rollout("task-7")`.
    Rollouts sharing a task_id form one GRPO group. Leaving the block marks the
    rollout succeeded, or failed (timeout for TimeoutError) with the exception
    text, records its duration, and flushes its traces to the store.

    `rewards` (a `RewardConfig`, a `Scorer` or a TOML/JSON file) scores the rollout as it ends:
    its components and their weighted sum, the final reward (docs/rewards.md).
    """
    return _RolloutScope(task_id, input=input, mode=mode, metadata=metadata, store=store,
                         rollout_id=rollout_id, policy_version=policy_version, flush_timeout=flush_timeout,
                         rewards=rewards)


def emit_reward(value: float, *, name: str | None = None, final: bool | None = None,
                metadata: dict[str, Any] | None = None, call_index: int | None = None,
                agent: str | None = None) -> None:
    """Reward the current rollout from anywhere inside it (arguments: `RolloutHandle.reward`)."""
    state = _current.get()
    if state is None:
        raise RuntimeError("emit_reward() called outside a rollout: wrap the agent run in `with rollout(...)`")
    record_reward(state, value, name=name, final=final, metadata=metadata, call_index=call_index, agent=agent)


class agent_scope:
    """Name the agent making the calls inside (multi-agent training keeps them apart)."""

    def __init__(self, name: str | None) -> None:
        self._name = name
        self._tokens: list[contextvars.Token[str | None]] = []

    def __enter__(self) -> None:
        self._tokens.append(_agent.set(self._name))

    def __exit__(self, *_exc: Any) -> None:
        _agent.reset(self._tokens.pop())

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *_exc: Any) -> None:
        self.__exit__()


def propagate(fn: F) -> F:
    """Bind `fn` to the current context, for `ThreadPoolExecutor.submit(propagate(fn), ...)`."""
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run(*a: Any, **kw: Any) -> Any:
        return ctx.copy().run(fn, *a, **kw)
    return run  # type: ignore[return-value]
