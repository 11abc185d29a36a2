"""Held-out evaluation inside the trainer: every N steps the daemon runs `mode="val"` rollouts of a
task set through the controller's evaluator, records them, keeps the best checkpoint by the chosen
metric (never pruned: `best.json` in the checkpoint directory names it) and stops early after
`patience` evaluations without improvement."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_middleware.controller import EarlyStopping, Evaluator
from lightning_middleware.records import EvalResult
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)

BEST_FILE = "best.json"


@dataclass(frozen=True)
class EvalPolicy:
    agent: str  # the agent function, "package.module:function" (it reaches the served model itself)
    tasks: str  # a JSONL task file (mode="val": never trained on)
    every: int = 10  # evaluate after every N steps
    n: int = 1  # samples per task
    metric: str = "success_rate"  # a key of the evaluation's metrics (controller/evaluation.py)
    higher_is_better: bool = True
    patience: int | None = None  # stop after this many evaluations without improvement (None: never)
    concurrency: int = 8
    timeout_s: float | None = None


@dataclass(frozen=True)
class Best:
    value: float
    step: int
    policy_version: int
    path: str


class PeriodicEvaluation:
    """What the daemon calls after each committed step."""

    def __init__(self, policy: EvalPolicy, store: TraceStore, checkpoint_dir: str) -> None:
        self.policy = policy
        self.store = store
        self.best_file = Path(checkpoint_dir) / BEST_FILE
        self.best = _read_best(self.best_file)
        self.stopping = EarlyStopping(patience=policy.patience or sys.maxsize, metric=policy.metric,
                                      higher_is_better=policy.higher_is_better,
                                      best=self.best.value if self.best else None)
        self._evaluator: Evaluator | None = None

    def due(self, step: int) -> bool:
        return self.policy.every > 0 and step % self.policy.every == 0

    def after_step(self, step: int, policy_version: int, checkpoint: Path) -> EvalResult | None:
        """Evaluate if due; remember the best checkpoint. Returns the result (None: not due)."""
        if not self.due(step):
            return None
        if self._evaluator is None:
            sys.path.insert(0, os.getcwd())  # "module:function" from where the trainer was started
            self._evaluator = Evaluator(self.policy.agent, self.policy.tasks, store=self.store, n=self.policy.n,
                                        controller_kwargs={"concurrency": self.policy.concurrency,
                                                           "timeout_s": self.policy.timeout_s,
                                                           "policy_version": policy_version})
        self._evaluator.controller.policy_version = policy_version  # tag the val rollouts with what serves them
        t0 = time.perf_counter()
        result = self._evaluator.evaluate(step=step)
        value = result.metrics.get(self.policy.metric)
        if not isinstance(value, (int, float)):
            raise KeyError(f"evaluation metric {self.policy.metric!r} not among {sorted(result.metrics)}")
        improved = self.best is None or (value > self.best.value if self.policy.higher_is_better
                                         else value < self.best.value)
        best = self.best
        if best is None or improved:
            best = self.best = Best(float(value), step, policy_version, str(checkpoint))
            _write_best(self.best_file, best)
        self.stopping.update(result.metrics)
        log.info("evaluation at step %d: %s %.4f (best %.4f at step %d) in %.1fs", step, self.policy.metric, value,
                 best.value, best.step, time.perf_counter() - t0)
        return result

    @property
    def should_stop(self) -> bool:
        return self.policy.patience is not None and self.stopping.should_stop

    def close(self) -> None:
        if self._evaluator is not None:
            self._evaluator.close()


def _read_best(path: Path) -> Best | None:
    try:
        return Best(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_best(path: Path, best: Best) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(best.__dict__, indent=2))
    tmp.replace(path)


def protected_checkpoints(checkpoint_dir: str) -> set[str]:
    """Checkpoint folder names pruning must keep (the best one)."""
    best = _read_best(Path(checkpoint_dir) / BEST_FILE)
    return {Path(best.path).name} if best is not None else set()
