"""Re-scoring stored rollouts under a (new) configuration, and calibrating the reward model
against human labels.

Re-scoring writes each rollout's components and final reward under the new configuration's
hash; the rewards stored before (the agent's, an older configuration's) stay as they are. Which
final reward the trainer sees is `apply`'s choice (combine.Scorer.score_rollout).

With a ranking judge the selected rollouts are scored by group: those of one task (and mode)
ranked together, so select whole groups (a `--limit` that cuts a group ranks its part); the
groups of a batch are ranked concurrently (`rank_judge.concurrency` at a time).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from lightning_middleware.records import Rollout, RolloutStatus
from lightning_middleware.rewards.combine import REWARD_MODEL, Scorer
from lightning_middleware.rewards.config import RewardConfig
from lightning_middleware.rewards.sources import Calibration, calibrate
from lightning_middleware.rewards.trajectory import HUMAN, Trajectory, load_trajectories
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
    # the ranking judge (zero without one): groups it ranked, groups it could not rank (its
    # answers never readable, or it failed), groups of one (nothing to rank), unreadable answers,
    # groups the other components told apart (not asked: rank_judge.scope = "uniform")
    groups_ranked: int = 0
    groups_failed: int = 0
    groups_of_one: int = 0
    unparseable_answers: int = 0
    groups_told_apart: int = 0

    def summary(self) -> str:
        """One line for a person (the `rewards rescore` command prints it)."""
        text = (f"re-scored {self.rollouts} rollouts under {self.config_hash}: {self.with_final} with a final "
                f"reward, {self.applied} applied to final_reward, {self.rewards_written} rewards written")
        if self.groups_ranked or self.groups_failed or self.groups_of_one or self.groups_told_apart:
            text += (f"; ranking judge: {self.groups_ranked} groups ranked, {self.groups_failed} failed, "
                     f"{self.groups_of_one} of one (not ranked), {self.unparseable_answers} unparseable answers")
            if self.groups_told_apart:
                text += f", {self.groups_told_apart} told apart by the other components (not ranked)"
        return text


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
    counts = dict.fromkeys(("n", "finals", "applied", "written"), 0)
    judge: Counter[str] = Counter()
    for group in _chunks(rollouts, batch, by_group=scorer.config.rank_judge is not None):
        trajectories = load_trajectories(store, group)
        groups = _groups(trajectories) if scorer.config.rank_judge is not None else [trajectories]
        # the chunk's groups ranked concurrently (rank_judge.concurrency), stored here one by one
        for members, (scored, ranking) in zip(groups, scorer.score_groups(groups, reuse_model=reuse_model)):
            if ranking is not None:
                judge.update(ranking.counts())
            for t, s in zip(members, scored):
                result = scorer.store_scored(store, t, apply=apply, scored=s)
                counts["n"] += 1
                counts["finals"] += s.final is not None
                counts["applied"] += result.applied
                counts["written"] += result.rewards
                if on_rollout is not None:
                    on_rollout(t.rollout.id, s.final)
    report = RescoreReport(scorer.hash, counts["n"], counts["finals"], counts["applied"], counts["written"],
                           judge["groups"], judge["failed"], judge["groups_of_one"], judge["unparseable"],
                           judge["groups_told_apart"])
    log.info("%s", report.summary())
    return report


def _key(r: Rollout) -> tuple[str, str]:
    return r.task_id, str(r.mode)


def _chunks(rollouts: Sequence[Rollout], batch: int, *, by_group: bool) -> Iterator[list[Rollout]]:
    """Slices of about `batch` rollouts; with `by_group`, whole groups (one task and mode) each."""
    if not by_group:
        for i in range(0, len(rollouts), batch):
            yield list(rollouts[i:i + batch])
        return
    groups: dict[tuple[str, str], list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(_key(r), []).append(r)
    chunk: list[Rollout] = []
    for members in groups.values():
        chunk.extend(members)
        if len(chunk) >= batch:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    out: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajectories:
        out.setdefault(_key(t.rollout), []).append(t)
    return list(out.values())


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
