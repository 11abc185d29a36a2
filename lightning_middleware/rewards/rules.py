"""Rule rewards: plain Python functions of the stored trajectory, and the built-in ones.

A rule is `fn(trajectory, **params) -> float | bool | Score | None`: a number (True is 1.0),
a `Score` with details kept beside the value, or None when the rule does not apply to this
rollout (the component is then absent: it adds nothing to the final reward). The configured
weight multiplies the value, so a rule that counts errors gets a negative weight.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.records import RolloutStatus
from lightning_middleware.rewards.config import Component, ConfigError
from lightning_middleware.rewards.trajectory import Trajectory


@dataclass(frozen=True)
class Score:
    """A rule's value with what it found (stored in the component's metadata)."""

    value: float
    detail: Mapping[str, Any] = field(default_factory=dict)


Rule = Callable[..., "float | bool | Score | None"]

# Tool results that report an error, and the subset that are syntax errors (the seeds' example).
ERROR_PATTERN = r"Traceback \(most recent call last\)|\b\w*(Error|Exception)\b|^error\b|\bexit (code|status) [1-9]"
SYNTAX_PATTERN = r"\b(SyntaxError|IndentationError|TabError)\b|invalid syntax|unexpected EOF while parsing"


def tool_call_valid(t: Trajectory, if_none: float | None = None) -> Score | None:
    """Share of the tool calls whose arguments are a JSON object and whose tool was offered
    (`if_none` when there were no tool calls; None: the component is absent)."""
    if not t.tool_calls:
        return None if if_none is None else Score(float(if_none), {"tool_calls": 0})
    valid = sum(tc.valid for tc in t.tool_calls)
    bad = [f"{tc.call_index}:{tc.name}" for tc in t.tool_calls if not tc.valid]
    return Score(valid / len(t.tool_calls), {"tool_calls": len(t.tool_calls), "invalid": bad[:20]})


def task_complete(t: Trajectory, threshold: float = 1.0) -> Score:
    """1.0 if the rollout succeeded and the agent reported a reward of at least `threshold`."""
    reported = t.reported_reward
    done = t.status == RolloutStatus.SUCCEEDED and reported is not None and reported >= threshold
    return Score(float(done), {"reported": reported, "status": str(t.status)})


def agent_reward(t: Trajectory) -> float | None:
    """The agent's own reported reward, as it is (absent if it reported none)."""
    return t.reported_reward


def succeeded(t: Trajectory) -> float:
    """1.0 if the rollout ended `succeeded` (no exception, no timeout)."""
    return float(t.status == RolloutStatus.SUCCEEDED)


def _matching(t: Trajectory, pattern: str, binary: bool) -> Score:
    rx = re.compile(pattern, re.IGNORECASE | re.MULTILINE)
    hits = [r for r in t.tool_results if rx.search(r.content)]
    found = [{"call_index": r.call_index, "tool": r.name, "text": rx.search(r.content).group(0)}  # type: ignore[union-attr]
             for r in hits[:20]]
    value = float(bool(hits)) if binary else float(len(hits))
    return Score(value, {"results": len(t.tool_results), "matched": found})


def tool_error(t: Trajectory, pattern: str = ERROR_PATTERN, binary: bool = False) -> Score:
    """Tool results that report an error (a traceback, an `...Error`, a non-zero exit): their
    count, or 1.0 if any with `binary`."""
    return _matching(t, pattern, binary)


def syntax_error(t: Trajectory, pattern: str = SYNTAX_PATTERN, binary: bool = False) -> Score:
    """Tool results that report a syntax error: their count, or 1.0 if any with `binary`."""
    return _matching(t, pattern, binary)


def step_reward_sum(t: Trajectory) -> float | None:
    """The sum of the rollout's per-step rewards (absent if it has none)."""
    steps = t.step_rewards
    return sum(steps.values()) if steps else None


BUILTIN_RULES: dict[str, Rule] = {
    "tool_call_valid": tool_call_valid,
    "task_complete": task_complete,
    "agent_reward": agent_reward,
    "succeeded": succeeded,
    "tool_error": tool_error,
    "syntax_error": syntax_error,
    "step_reward_sum": step_reward_sum,
}


def import_function(path: str, what: str) -> Callable[..., Any]:
    """`package.module:function` imported; ConfigError saying what is wrong otherwise."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"{what} {path!r} is neither a built-in nor 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{what} {path!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ConfigError(f"{what} {path!r} is not callable")
    return fn


def resolve(component: Component, builtins: Mapping[str, Rule]) -> Rule:
    """The function a component names: a built-in of its kind, an import path, or itself."""
    fn = component.function
    if callable(fn):
        return fn
    if fn in builtins:
        return builtins[fn]
    if ":" not in fn:
        raise ConfigError(f"{component.kind} {component.name!r}: no built-in {component.kind} {fn!r} "
                          f"(built-ins: {', '.join(sorted(builtins))}; or give function = 'package.module:function')")
    return import_function(fn, f"{component.kind} {component.name!r}: function")


def as_score(result: Any, where: str) -> Score | None:
    """A rule's return value as a Score (None stays None); TypeError for anything else."""
    if result is None:
        return None
    if isinstance(result, Score):
        value, detail = result.value, result.detail
    elif isinstance(result, (bool, int, float)):
        value, detail = float(result), {}
    else:
        raise TypeError(f"{where} returned {type(result).__name__}, not a number, a Score or None")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{where} returned {value!r}, not a finite number")
    return Score(float(value), detail)
