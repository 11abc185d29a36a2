"""What the demo measures on stored rollouts, whatever reward trains them: the task's own
success (the agent's reported reward, never a configured combination), tool calls per rollout,
and which reward-hacking guards fired.

A configured reward (`lightning-mw demo --rewards FILE`) makes `RolloutResult.reward` the
combined final reward, which a hackable configuration can raise without the task being solved;
the evaluation and the curve therefore read the agent's own reward from the store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_middleware import Reward, TraceStore
from lightning_middleware.controller import RolloutResult
from lightning_middleware.rewards.trajectory import load_trajectories

SOLVED = 1.0  # the demo agents report 1.0 for a solved task


@dataclass(frozen=True)
class Outcome:
    """One rollout as the demo reports it."""

    rollout_id: str
    success: bool  # the agent's own reward >= SOLVED
    tool_calls: int
    guards_fired: tuple[str, ...]  # guards with a verdict > 0 under the rollout's configuration
    guards_run: tuple[str, ...] = ()  # every guard with a stored verdict (none: no guards configured)


def _guards(rewards: Sequence[Reward]) -> dict[str, float]:
    """The latest verdict of each configured guard (a rescore may store newer ones)."""
    latest: dict[str, float] = {}
    for r in rewards:
        if r.config_hash is not None and (r.metadata or {}).get("source") == "guard":
            latest[str(r.name)] = r.value
    return latest


def task_outcomes(store: TraceStore, rollout_ids: Sequence[str]) -> list[Outcome]:
    """The outcomes of stored rollouts (unknown ids are left out), with a few queries."""
    store.flush()
    rollouts = [r for r in (store.get_rollout(i) for i in dict.fromkeys(rollout_ids)) if r is not None]
    out = []
    for t in load_trajectories(store, rollouts):
        reported = t.reported_reward
        verdicts = _guards(t.rewards)
        out.append(Outcome(t.rollout.id, reported is not None and reported >= SOLVED, len(t.tool_calls),
                           tuple(sorted(n for n, v in verdicts.items() if v > 0)), tuple(sorted(verdicts))))
    return out


def summarize(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """success, tool_calls_mean and, where guards ran, hacking_rate and guard_<name>_rate."""
    n = len(outcomes)
    if not n:
        return {}
    out = {"success": sum(o.success for o in outcomes) / n,
           "tool_calls_mean": sum(o.tool_calls for o in outcomes) / n}
    names = sorted({name for o in outcomes for name in o.guards_run})
    if names:
        fired = Counter(name for o in outcomes for name in o.guards_fired)
        out["hacking_rate"] = sum(bool(o.guards_fired) for o in outcomes) / n
        out.update({f"guard_{name}_rate": fired[name] / n for name in names})
    return out


def curve_summary(curve: Sequence[dict[str, float]], last: float = 0.25) -> dict[str, dict[str, float]]:
    """Per-step measures averaged over the whole RL phase and over its `last` share of steps
    (the policy it ended with): success, tool calls per rollout, hacking and guard rates. Each
    step weighs by the rollouts that finished in it (`finished`): short episodes finish first,
    so a step with a handful of them is no fair sample (the trained batch's rates: by step)."""
    keys = sorted({k for c in curve for k in c
                   if k in ("success", "tool_calls_mean", "hacking_rate", "batch_hacking_rate")
                   or k.startswith(("guard_", "batch_guard_"))})

    def mean(rows: Sequence[dict[str, float]], key: str) -> float:
        weigh = not key.startswith("batch_")
        xs = [(float(c[key]), float(c.get("finished", 1)) if weigh else 1.0)
              for c in rows if key in c and c[key] == c[key]]  # NaN: no rollout finished
        total = sum(w for _, w in xs)
        return sum(x * w for x, w in xs) / total if total else float("nan")

    tail = list(curve[-max(1, round(len(curve) * last)):]) if curve else []
    return {"all_steps": {k: mean(curve, k) for k in keys}, "last_steps": {k: mean(tail, k) for k in keys}}


def step_outcomes(store: TraceStore | None, new: Sequence[RolloutResult]) -> dict[str, float]:
    """The task's own success of the train rollouts finished since the last step (not a
    configured reward), their mean tool calls and guard rates. Without the store (a caller
    that keeps none), success from the results' rewards alone."""
    if not new:
        return {}
    if store is None:
        return {"success": sum(1 for r in new if (r.reward or 0.0) >= SOLVED) / len(new)}
    outcomes = task_outcomes(store, [r.rollout_id for r in new])
    return {**summarize(outcomes), "success": sum(o.success for o in outcomes) / len(new)}


def report_line(res: dict[str, Any]) -> str:
    """Tool calls per held-out rollout before and after RL, the hacking rate at the end of RL
    (when guards ran) and the reward configuration's hash: the demo's closing summary."""
    before, after = res["before"]["sampled"], res["after"]["sampled"]
    parts = []
    if "tool_calls_mean" in before and "tool_calls_mean" in after:  # tasks without outcomes (team) have none
        parts.append(f"tool calls per held-out rollout: {before['tool_calls_mean']:.2f} -> "
                     f"{after['tool_calls_mean']:.2f}")
    rl = res.get("rl_summary", {}).get("last_steps", {})
    rate = rl.get("hacking_rate")
    if rate is not None and rate == rate:  # NaN: no train rollout finished in the last steps
        parts.append(f"hacking rate of the train rollouts (last quarter of RL): {rl['hacking_rate']:.1%}")
    if res.get("rewards"):
        parts.append(f"reward configuration {res['rewards']['hash']}")
    return "; ".join(parts)
