"""Evaluation: `mode="val"` rollouts on a held-out task set, metrics stored and shown.

    ev = Evaluator(controller, "val.jsonl", n=2, every_n_steps=10,
                   early_stopping=EarlyStopping(patience=3))
    for step in training:
        ...
        ev.maybe_evaluate(step)          # every 10 steps: runs, stores, returns the EvalResult
        if ev.should_stop: break

Metrics (definitions in docs/controller.md) are computed from the store by
`compute_metrics`, so they can be recomputed for any set of rollouts. Each
evaluation is one `eval_results` row (name, step, policy_version, metrics JSON,
rollout ids).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.controller.execution import AgentFn, no_running_loop
from lightning_middleware.controller.rollout_controller import RolloutController
from lightning_middleware.controller.tasks import load_tasks
from lightning_middleware.records import EvalResult, LLMCall, Mode, Rollout, RolloutStatus
from lightning_middleware.rows import counted_attempts
from lightning_middleware.store import TraceStore, get_store

NO_AGENT = "(unnamed)"


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------

def tool_call_checks(call: LLMCall) -> list[bool]:
    """For each tool call in the response: do its arguments parse as JSON and does the
    tool exist in the request's `tools`?"""
    offered = set()
    for t in (call.request or {}).get("tools") or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and fn.get("name"):
            offered.add(fn["name"])
    out = []
    for choice in ((call.response or {}).get("choices") or [])[:1]:
        for tc in ((choice or {}).get("message") or {}).get("tool_calls") or []:
            fn = tc.get("function") or {}
            try:
                json.loads(fn.get("arguments") or "")
                parses = True
            except (TypeError, ValueError):
                parses = False
            out.append(parses and fn.get("name") in offered)
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def compute_metrics(store: TraceStore, rollouts: Sequence[Rollout | str], *,
                    success_threshold: float = 1.0) -> dict[str, Any]:
    """Metrics over `rollouts` (records or ids). See docs/controller.md for definitions."""
    found = [r if isinstance(r, Rollout) else store.get_rollout(r) for r in rollouts]
    rs = [r for r in found if r is not None]
    calls_by = store.calls_for([r.id for r in rs]) if rs else {}
    n = len(rs)
    rewards = [r.final_reward if r.final_reward is not None else 0.0 for r in rs]
    success = [r.status == RolloutStatus.SUCCEEDED.value and r.final_reward is not None
               and r.final_reward >= success_threshold for r in rs]
    tasks: dict[str, list[bool]] = {}
    for r, ok in zip(rs, success):
        tasks.setdefault(r.task_id, []).append(ok)

    turns: list[int] = []
    tokens: list[int] = []
    completion: list[int] = []
    checks: list[bool] = []
    agents: dict[str, dict[str, Any]] = {}
    for r, reward in zip(rs, rewards):
        calls = counted_attempts(calls_by.get(r.id, []))
        turns.append(len(calls))
        tokens.append(sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in calls))
        completion.append(sum(len(c.completion_token_ids) for c in calls))
        seen_agents: set[str] = set()
        for c in calls:
            name = c.agent_name or NO_AGENT
            a = agents.setdefault(name, {"calls": 0, "rollouts": 0, "tokens": 0, "checks": [], "rewards": []})
            a["calls"] += 1
            a["tokens"] += len(c.prompt_token_ids) + len(c.completion_token_ids)
            ch = tool_call_checks(c)
            a["checks"].extend(ch)
            checks.extend(ch)
            if name not in seen_agents:
                seen_agents.add(name)
                a["rollouts"] += 1
                a["rewards"].append(reward)

    statuses = Counter(r.status for r in rs)
    per_agent = {
        name: {
            "rollouts": a["rollouts"],
            "calls": a["calls"],
            "turns_per_rollout": a["calls"] / a["rollouts"],
            "tokens_per_rollout": a["tokens"] / a["rollouts"],
            "tool_calls": len(a["checks"]),
            "tool_call_accuracy": _mean([float(x) for x in a["checks"]]),
            "mean_reward": _mean(a["rewards"]),
        }
        for name, a in sorted(agents.items())
    }
    return {
        "rollouts": n,
        "tasks": len(tasks),
        "statuses": dict(sorted(statuses.items())),
        "completion_rate": _mean([float(r.status == RolloutStatus.SUCCEEDED.value) for r in rs]),
        "success_rate": _mean([float(x) for x in success]),
        "task_success_rate": _mean([float(any(v)) for v in tasks.values()]),
        "mean_reward": _mean(rewards),
        "reward_std": statistics.pstdev(rewards) if n else None,
        "avg_turns": _mean([float(t) for t in turns]),
        "tool_calls": len(checks),
        "tool_call_accuracy": _mean([float(x) for x in checks]),
        "tokens_per_rollout": _mean([float(t) for t in tokens]),
        "completion_tokens_per_rollout": _mean([float(t) for t in completion]),
        "per_agent": per_agent,
        "success_threshold": success_threshold,
    }


def reward_smoothness(mean_rewards: Sequence[float | None]) -> float | None:
    """Population std of the step-to-step changes of mean reward (0 = a perfectly
    steady trend; larger = noisier). None with fewer than 3 evaluations."""
    xs = [x for x in mean_rewards if x is not None]
    if len(xs) < 3:
        return None
    return statistics.pstdev([b - a for a, b in zip(xs, xs[1:])])


# --------------------------------------------------------------------------
# Early stopping and the evaluator
# --------------------------------------------------------------------------

@dataclass
class EarlyStopping:
    """Stop after `patience` evaluations without improving `metric` by more than `min_delta`."""

    patience: int = 3
    metric: str = "mean_reward"
    min_delta: float = 0.0
    higher_is_better: bool = True
    best: float | None = None
    bad_evals: int = 0
    history: list[float] = field(default_factory=list)

    def update(self, metrics: dict[str, Any]) -> bool:
        """Record one evaluation; True if training should stop now."""
        value = metrics.get(self.metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            self.bad_evals += 1
        else:
            value = float(value)
            self.history.append(value)
            better = (self.best is None or
                      (value > self.best + self.min_delta if self.higher_is_better
                       else value < self.best - self.min_delta))
            if better:
                self.best, self.bad_evals = value, 0
            else:
                self.bad_evals += 1
        return self.should_stop

    @property
    def should_stop(self) -> bool:
        return self.bad_evals >= self.patience


class Evaluator:
    """Run `mode="val"` rollouts of `tasks` (n each) with a controller and store the metrics.

    `runner` is a `RolloutController` (its backend, concurrency, timeouts are used)
    or an agent function / "module:function" (a controller is made with
    `controller_kwargs`). `every_n_steps`: `maybe_evaluate(step)` evaluates when
    step % every_n_steps == 0.
    """

    def __init__(self, runner: RolloutController | AgentFn | str, tasks: Any, *,
                 store: TraceStore | str | None = None, n: int = 1,
                 every_n_steps: int | None = None, name: str = "val", success_threshold: float = 1.0,
                 early_stopping: EarlyStopping | None = None,
                 controller_kwargs: dict[str, Any] | None = None) -> None:
        if isinstance(runner, RolloutController):
            self.controller = runner
            self._owns = False
        else:
            self.controller = RolloutController(runner, store=store, **(controller_kwargs or {}))
            self._owns = True
        self.store = get_store(store) if store is not None else self.controller.store
        self.tasks = [t for _, t in load_tasks(tasks, task_id_key=self.controller.task_id_key,
                                                 timeout_key=self.controller.timeout_key)]
        self.n = n
        self.every_n_steps = every_n_steps
        self.name = name
        self.success_threshold = success_threshold
        self.early_stopping = early_stopping
        self.results: list[EvalResult] = []

    @property
    def should_stop(self) -> bool:
        return self.early_stopping is not None and self.early_stopping.should_stop

    def due(self, step: int) -> bool:
        return self.every_n_steps is not None and self.every_n_steps > 0 and step % self.every_n_steps == 0

    def maybe_evaluate(self, step: int) -> EvalResult | None:
        return self.evaluate(step=step) if self.due(step) else None

    def evaluate(self, step: int | None = None) -> EvalResult:
        no_running_loop("evaluate")
        return self.controller.run_sync(self.aevaluate(step=step))

    async def aevaluate(self, step: int | None = None) -> EvalResult:
        results = await self.controller.arun(self.tasks, n=self.n, mode=Mode.VAL.value,
                                             metadata={"eval": self.name, "step": step})
        ids = [r.rollout_id for r in results]
        return await asyncio.to_thread(self.record, ids, step)

    def record(self, rollout_ids: Sequence[str], step: int | None = None) -> EvalResult:
        """Compute the metrics of these rollouts, add history metrics, store and return the result."""
        rollouts = [r for r in (self.store.get_rollout(i) for i in rollout_ids) if r is not None]
        metrics = compute_metrics(self.store, rollouts, success_threshold=self.success_threshold)
        history = [e.metrics.get("mean_reward") for e in self.store.eval_results(self.name)]
        metrics["reward_smoothness"] = reward_smoothness([*history, metrics["mean_reward"]])
        metrics["evaluations"] = len(history) + 1
        versions = Counter(r.policy_version for r in rollouts if r.policy_version is not None)
        pv = versions.most_common(1)[0][0] if versions else None
        if self.early_stopping is not None:
            self.early_stopping.update(metrics)
            metrics["early_stop"] = {"metric": self.early_stopping.metric, "best": self.early_stopping.best,
                                     "bad_evals": self.early_stopping.bad_evals,
                                     "patience": self.early_stopping.patience,
                                     "stop": self.early_stopping.should_stop}
        result = EvalResult(name=self.name, step=step, policy_version=pv, created_at=time.time(),
                            metrics=metrics, rollout_ids=tuple(rollout_ids))
        rid = self.store.add_eval_result(result)
        result = EvalResult(**{**result.__dict__, "id": rid})
        self.results.append(result)
        return result

    def close(self) -> None:
        if self._owns:
            self.controller.close()


# --------------------------------------------------------------------------
# Display
# --------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


_SHOWN = ("rollouts", "tasks", "success_rate", "task_success_rate", "completion_rate", "mean_reward",
          "reward_std", "avg_turns", "tool_calls", "tool_call_accuracy", "tokens_per_rollout",
          "completion_tokens_per_rollout", "reward_smoothness")


def format_metrics(metrics: dict[str, Any]) -> str:
    """A plain-text table of one evaluation's metrics (per-agent rows when several agents)."""
    lines = [f"{k:30s} {_fmt(metrics.get(k))}" for k in _SHOWN if k in metrics]
    lines.append(f"{'statuses':30s} {metrics.get('statuses')}")
    agents = metrics.get("per_agent") or {}
    if agents:
        lines.append(f"{'agent':16s} {'rollouts':>8s} {'calls':>6s} {'turns':>6s} {'tokens':>8s} "
                     f"{'tool_acc':>8s} {'reward':>7s}")
        for name, a in agents.items():
            lines.append(f"{name[:16]:16s} {a['rollouts']:8d} {a['calls']:6d} {_fmt(a['turns_per_rollout']):>6s} "
                         f"{_fmt(a['tokens_per_rollout']):>8s} {_fmt(a['tool_call_accuracy']):>8s} "
                         f"{_fmt(a['mean_reward']):>7s}")
    if "early_stop" in metrics:
        lines.append(f"{'early_stop':30s} {metrics['early_stop']}")
    return "\n".join(lines)


def format_history(results: Sequence[EvalResult]) -> str:
    """One line per stored evaluation."""
    head = f"{'name':8s} {'step':>6s} {'policy':>6s} {'success':>8s} {'reward':>7s} {'turns':>6s} " \
           f"{'tool_acc':>8s} {'tokens':>8s} {'smooth':>7s}"
    rows = [head]
    for e in results:
        m = e.metrics
        rows.append(f"{e.name[:8]:8s} {_fmt(e.step):>6s} {_fmt(e.policy_version):>6s} "
                    f"{_fmt(m.get('success_rate')):>8s} {_fmt(m.get('mean_reward')):>7s} "
                    f"{_fmt(m.get('avg_turns')):>6s} {_fmt(m.get('tool_call_accuracy')):>8s} "
                    f"{_fmt(m.get('tokens_per_rollout')):>8s} {_fmt(m.get('reward_smoothness')):>7s}")
    return "\n".join(rows)


__all__ = ["EarlyStopping", "Evaluator", "compute_metrics", "format_history", "format_metrics",
           "reward_smoothness", "tool_call_checks"]

