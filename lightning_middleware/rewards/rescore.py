"""Re-scoring stored rollouts under a (new) configuration, and calibrating the reward model
against human labels.

Re-scoring writes each rollout's components and final reward under the new configuration's
hash; the rewards stored before (the agent's, an older configuration's) stay as they are. Which
final reward the trainer sees is `apply`'s choice (combine.Scorer.score_rollout).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_middleware.records import RolloutStatus
from lightning_middleware.rewards.combine import REWARD_MODEL, Scorer
from lightning_middleware.rewards.config import RewardConfig
from lightning_middleware.rewards.sources import Calibration, calibrate
from lightning_middleware.rewards.trajectory import HUMAN, load_trajectories
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)

ENDED = [RolloutStatus.SUCCEEDED.value, RolloutStatus.FAILED.value, RolloutStatus.TIMEOUT.value]


@dataclass(frozen=True)
class RescoreReport:
    config_hash: str
    rollouts: int  # rollouts scored
    with_final: int  # of which got a final reward
    applied: int  # of which the final reward became the rollout's final_reward
    rewards_written: int


def rescore(store: TraceStore, config: RewardConfig | Scorer, *, rollout_ids: Sequence[str] | None = None,
            task_id: str | None = None, mode: str | None = None, since: float | None = None,
            limit: int | None = None, apply: str = "unconsumed", reuse_model: bool = False,
            batch: int = 200, on_rollout: Callable[[str, float | None], None] | None = None) -> RescoreReport:
    """Score the ended rollouts (all, or those selected) under `config` and store the results."""
    scorer = config if isinstance(config, Scorer) else Scorer(config)
    if rollout_ids is not None:
        found = [store.get_rollout(rid) for rid in rollout_ids]
        missing = [rid for rid, r in zip(rollout_ids, found) if r is None]
        if missing:
            raise KeyError(f"no rollouts {missing[:5]} in {store.safe_url}")
        rollouts = [r for r in found if r is not None]
    else:
        rollouts = store.query_rollouts(status=ENDED, task_id=task_id, mode=mode, since=since, limit=limit)
    n = finals = applied = written = 0
    for i in range(0, len(rollouts), batch):
        for t in load_trajectories(store, rollouts[i:i + batch]):
            result = scorer.store_scored(store, t, apply=apply, reuse_model=reuse_model)
            n += 1
            finals += result.scored.final is not None
            applied += result.applied
            written += result.rewards
            if on_rollout is not None:
                on_rollout(t.rollout.id, result.scored.final)
    log.info("re-scored %d rollouts under %s: %d with a final reward, %d applied", n, scorer.hash, finals, applied)
    return RescoreReport(scorer.hash, n, finals, applied, written)


def calibration(store: TraceStore, *, config_hash: str | None = None, batch: int = 500) -> Calibration:
    """The reward model's values against the human labels, over the rollouts that have both (the
    model's latest value under `config_hash`, or under any configuration); ValueError if < 2."""
    pairs = []
    rollouts = store.query_rollouts(status=ENDED)
    for i in range(0, len(rollouts), batch):
        chunk = store.rewards_for([r.id for r in rollouts[i:i + batch]])
        for rewards in chunk.values():
            labels = [r.value for r in rewards if r.name == HUMAN and r.config_hash is None]
            model = [r.value for r in rewards if r.name == REWARD_MODEL and r.config_hash is not None
                     and (config_hash is None or r.config_hash == config_hash)]
            if labels and model:
                pairs.append((model[-1], sum(labels) / len(labels)))
    return calibrate(pairs)
