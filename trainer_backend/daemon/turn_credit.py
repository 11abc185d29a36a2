"""The daemon's side of per-turn credit (algorithms/credit.py): the per-step rewards it reads
from the store, for the uniform-group check, the labelling and the step's metrics.

With `credit = "rollout"` (the default) it reads nothing and adds nothing: the step is the
rollout-level one, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_middleware import Rollout, TraceStore
from lightning_middleware.records import LLMCall
from lightning_middleware.rows import Row
from trainer_backend.algorithms import credit


class TurnCredit:
    def __init__(self, store: TraceStore, mode: str = "rollout", gamma: float = 1.0) -> None:
        self.store = store
        self.mode = mode
        self.gamma = gamma

    @property
    def per_turn(self) -> bool:
        return self.mode == "per-turn"

    def step_rewards(self, rollout_ids: Sequence[str]) -> dict[str, dict[int, float]]:
        """Per rollout, call index -> per-step reward; {} with rollout credit (nothing to read).
        A group whose rollouts agree on their final and per-step rewards has no signal."""
        return self.store.step_rewards(rollout_ids) if self.per_turn and rollout_ids else {}

    def for_batch(self, rollouts: Sequence[Rollout], calls: Mapping[str | None, Sequence[LLMCall]]
                  ) -> credit.StepRewards | None:
        """What the labelling takes (None: rollout-level); `calls` by rollout id (`calls_for`)."""
        if not self.per_turn:
            return None
        return credit.StepRewards(calls={r.id: calls.get(r.id, ()) for r in rollouts},
                                  steps=self.step_rewards([r.id for r in rollouts]), gamma=self.gamma)

    @staticmethod
    def metrics(rows: Sequence[Row], given: credit.StepRewards | None) -> dict[str, float]:
        return credit.step_metrics(rows, given) if given is not None else {}
