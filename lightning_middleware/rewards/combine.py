"""Scoring a rollout under a configuration: every component, then the weighted final reward.

Each component is stored as its own reward (name = the component's, `config_hash` = the
configuration's, `metadata` = its source, weight and what it found); the final reward is
sum(weight x value) over the components that have a value, stored as the reward "final" with
the same hash. That final reward is the rollout's `final_reward` (the number the trainer reads)
under the store's rule: while no trainer has claimed or consumed the rollout.

A component that fails (a rule raising, the judge unreachable) is recorded in a "reward_errors"
reward; with `on_error = "drop"` (the default) the rollout then gets no final reward, so it is
never trained on a signal with a term missing; with "partial" the final reward is the sum of the
rest. A component that does not apply (a rule returning None, no human label yet) is absent.

The ranking judge (ranking.py) scores a group, not a rollout: `score_group` asks it once for
the group and scores each member with its share. A rollout scored alone (as it ends, or again
after a late label) reuses the value its group got; before its group is ranked the component is
pending and the rollout has no final reward yet, so nothing trains on a sum with the judge's
term missing; a "reward_pending" reward (its metadata names the pending components) says so,
so a trainer that cannot rank (no `--reward-config`) can tell "waiting for a ranking" from
"no reward" and say what to do. A group of one has no ranking: the component is absent, the final's metadata
says why (`notes`). With `rank_judge.scope = "uniform"` the judge is asked only for a group whose
other components give every member one final reward; in a group they already tell apart the
component is absent in every member (so the group's advantages compare like with like), noted so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.records import Reward, RolloutStatus
from lightning_middleware.rewards.config import RANK_JUDGE, Component, RewardConfig
from lightning_middleware.rewards.guards import BUILTIN_GUARDS
from lightning_middleware.rewards.ranking import TOLD_APART, GroupRanking, rank_groups
from lightning_middleware.rewards.rules import BUILTIN_RULES, Rule, Score, as_score, resolve
from lightning_middleware.rewards.sources import human_score, local_scorer, model_score
from lightning_middleware.rewards.trajectory import HUMAN, Trajectory, load_trajectory
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)

FINAL = "final"
ERRORS = "reward_errors"
PENDING = "reward_pending"  # a rollout's components still to come (the ranking of its group)
RANKED_BY = "the trainer's --reward-config (it ranks each ready group) or `lightning-mw rewards rescore`"
REWARD_MODEL = "reward_model"
APPLY = ("none", "unconsumed", "all")


@dataclass(frozen=True)
class ComponentValue:
    name: str
    source: str  # rule | guard | reward_model | human
    weight: float
    value: float | None  # None: absent, or failed (then `error` says why)
    detail: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None
    note: str | None = None  # why an absent component is absent (kept in the final's metadata)
    pending: bool = False  # still to come (the ranking of the rollout's group): no final reward yet


@dataclass(frozen=True)
class Scored:
    rollout_id: str
    config_hash: str
    components: tuple[ComponentValue, ...]
    final: float | None  # None: dropped (a component failed and on_error is "drop")
    zeroed_by: tuple[str, ...] = ()  # the guards with action "zero" that fired (final is then 0.0)

    @property
    def values(self) -> dict[str, float]:
        return {c.name: c.value for c in self.components if c.value is not None}

    @property
    def errors(self) -> dict[str, str]:
        return {c.name: c.error for c in self.components if c.error is not None}

    @property
    def pending(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components if c.pending)


@dataclass(frozen=True)
class Written:
    scored: Scored
    rewards: int  # reward rows written (unchanged components are not written again)
    applied: bool  # the final reward became the rollout's final_reward


def _latest(rewards: Sequence[Reward], name: str, config_hash: str) -> Reward | None:
    found = [r for r in rewards if r.name == name and r.config_hash == config_hash]
    return found[-1] if found else None


class Scorer:
    """A configuration with its functions resolved (a bad name fails here, at set-up)."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.hash = config.hash
        builtins: dict[str, Mapping[str, Rule]] = {"rule": BUILTIN_RULES, "guard": BUILTIN_GUARDS}
        self._functions = {c.name: resolve(c, builtins[c.kind]) for c in config.components}
        self._scorer = local_scorer(config.reward_model) if config.reward_model else None
        self._zeroing = {c.name for c in config.guards if c.action == "zero"}
        self._hinted = False  # the "waiting for its group" hint is logged once per scorer

    # -- computing -----------------------------------------------------------------
    def _run(self, c: Component, t: Trajectory) -> ComponentValue:
        try:
            score = as_score(self._functions[c.name](t, **c.params), f"{c.kind} {c.name!r}")
        except Exception as exc:  # noqa: BLE001 - a user's rule: recorded, never fatal to the rollout
            log.warning("%s %r failed on rollout %s: %s: %s", c.kind, c.name, t.rollout.id, type(exc).__name__, exc)
            return ComponentValue(c.name, c.kind, c.weight, None, error=f"{type(exc).__name__}: {exc}")
        return self._value(c.name, c.kind, c.weight, score)

    @staticmethod
    def _value(name: str, source: str, weight: float, score: Score | None) -> ComponentValue:
        if score is None:
            return ComponentValue(name, source, weight, None)
        return ComponentValue(name, source, weight, score.value, dict(score.detail))

    def _model(self, t: Trajectory, reuse: bool) -> ComponentValue:
        cfg = self.config.reward_model
        assert cfg is not None
        stored = _latest(t.rewards, REWARD_MODEL, self.hash) if reuse else None
        if stored is not None:
            return ComponentValue(REWARD_MODEL, REWARD_MODEL, cfg.weight, stored.value,
                                  dict(stored.metadata.get("detail") or {}))
        try:
            return self._value(REWARD_MODEL, REWARD_MODEL, cfg.weight, model_score(t, cfg, self._scorer))
        except Exception as exc:  # noqa: BLE001 - recorded as the component's error
            log.warning("reward model failed on rollout %s: %s", t.rollout.id, exc)
            return ComponentValue(REWARD_MODEL, REWARD_MODEL, cfg.weight, None, error=f"{type(exc).__name__}: {exc}")

    def _stored_rank(self, t: Trajectory) -> ComponentValue:
        """The ranking judge's value from the rollout's group, as stored; pending if none yet."""
        cfg = self.config.rank_judge
        assert cfg is not None
        stored = _latest(t.rewards, RANK_JUDGE, self.hash)
        if stored is not None:
            return ComponentValue(RANK_JUDGE, RANK_JUDGE, cfg.weight, stored.value,
                                  dict(stored.metadata.get("detail") or {}))
        final = _latest(t.rewards, FINAL, self.hash)
        note = ((final.metadata.get("notes") or {}).get(RANK_JUDGE) if final is not None else None)
        if note:  # its group was scored and had no ranking (a group of one): still absent
            return ComponentValue(RANK_JUDGE, RANK_JUDGE, cfg.weight, None, note=str(note))
        return ComponentValue(RANK_JUDGE, RANK_JUDGE, cfg.weight, None, pending=True,
                              note="waiting for its group to be ranked")

    def _group_rank(self, ranking: GroupRanking, rollout_id: str) -> ComponentValue:
        cfg = self.config.rank_judge
        assert cfg is not None
        if ranking.error is not None:
            return ComponentValue(RANK_JUDGE, RANK_JUDGE, cfg.weight, None, error=ranking.error)
        if rollout_id not in ranking.values:
            return ComponentValue(RANK_JUDGE, RANK_JUDGE, cfg.weight, None, note=ranking.note)
        return ComponentValue(RANK_JUDGE, RANK_JUDGE, cfg.weight, ranking.values[rollout_id],
                              dict(ranking.detail[rollout_id]))

    def score_group(self, group: Sequence[Trajectory], *, reuse_model: bool = False) -> tuple[list[Scored],
                                                                                                GroupRanking | None]:
        """Score the rollouts of one group (one task), the ranking judge asked once for all of them
        (unless `reuse_model` and each already has its value). The ranking is None without a judge."""
        return self.score_groups([group], reuse_model=reuse_model)[0]

    def score_groups(self, groups: Sequence[Sequence[Trajectory]], *, reuse_model: bool = False
                     ) -> list[tuple[list[Scored], GroupRanking | None]]:
        """`score_group` for each group, the judge ranking them concurrently (`rank_judge.concurrency`
        at a time): a slow judge costs about one latency for a round of groups, not one per group."""
        return [s for s in self._score_groups(groups, reuse_model, rank=True) if s is not None]

    def score_told_apart(self, groups: Sequence[Sequence[Trajectory]], *, reuse_model: bool = False
                         ) -> list[tuple[list[Scored], GroupRanking | None] | None]:
        """`score_groups` without asking the judge: with `rank_judge.scope = "uniform"` the groups
        the other components tell apart are scored (as `score_groups` would), and each group the
        judge would rank is None, left for a later `score_groups` (the trainer's collect takes the
        groups with signal now and leaves the tied ones to its rank-ahead thread). With scope
        "all" every group needs the judge, so every group is None."""
        return self._score_groups(groups, reuse_model, rank=False)

    def _score_groups(self, groups: Sequence[Sequence[Trajectory]], reuse_model: bool, *, rank: bool
                      ) -> list[tuple[list[Scored], GroupRanking | None] | None]:
        cfg = self.config.rank_judge
        # scope "uniform": every other component first (once), to see which groups they tell apart
        others = {id(t): self._others(t, reuse_model) for g in groups for t in g} \
            if cfg is not None and cfg.scope == "uniform" else {}
        told_apart = {id(g) for g in groups if others and self._tell_apart(g, others)}
        asked = [g for g in groups if cfg is not None and id(g) not in told_apart and not (
            reuse_model and all(_latest(t.rewards, RANK_JUDGE, self.hash) for t in g))]
        rankings = dict(zip(map(id, asked), rank_groups(asked, cfg))) if cfg is not None and rank else {}
        rankings.update({i: GroupRanking(note=TOLD_APART) for i in told_apart})
        deferred: set[int] = set() if rank else {id(g) for g in asked}
        out: list[tuple[list[Scored], GroupRanking | None] | None] = []
        for g in groups:
            if id(g) in deferred:
                out.append(None)
                continue
            ranking = rankings.get(id(g))
            out.append(([self.score(t, reuse_model=reuse_model,
                                    rank=None if ranking is None else self._group_rank(ranking, t.rollout.id),
                                    others=others.get(id(t)))
                         for t in g], ranking))
        return out

    def _tell_apart(self, group: Sequence[Trajectory], others: Mapping[int, tuple[list[ComponentValue],
                                                                                   list[ComponentValue]]]) -> bool:
        """Whether the components other than the judge give the group's members more than one final reward."""
        cfg = self.config.rank_judge
        assert cfg is not None
        absent = ComponentValue(RANK_JUDGE, RANK_JUDGE, cfg.weight, None)
        finals = [self._scored(t, [*others[id(t)][0], absent, *others[id(t)][1]]).final for t in group]
        return None not in finals and len(set(finals)) > 1

    def _others(self, t: Trajectory, reuse_model: bool) -> tuple[list[ComponentValue], list[ComponentValue]]:
        """Every component but the ranking judge's: those before it, and those after it (the human's)."""
        before = [self._run(c, t) for c in self.config.components]
        if self.config.reward_model is not None:
            before.append(self._model(t, reuse_model))
        after = []
        if self.config.human is not None:
            after.append(self._value(HUMAN, HUMAN, self.config.human.weight, human_score(t)))
        return before, after

    def score(self, t: Trajectory, *, reuse_model: bool = False, rank: ComponentValue | None = None,
              others: tuple[list[ComponentValue], list[ComponentValue]] | None = None) -> Scored:
        """Every component of `t` and the final reward. `reuse_model`: take the reward model's
        value stored under this configuration, if there is one, instead of asking it again.
        `rank`: the ranking judge's component from `score_group` (else the stored one); `others`:
        the rest, computed already by `score_groups`."""
        before, after = others if others is not None else self._others(t, reuse_model)
        judge = [rank if rank is not None else self._stored_rank(t)] if self.config.rank_judge is not None else []
        return self._scored(t, [*before, *judge, *after])

    def _scored(self, t: Trajectory, parts: list[ComponentValue]) -> Scored:
        """The final reward of `t` from its components' values."""
        failed = any(p.error for p in parts)
        final = None if (failed and self.config.on_error == "drop") or any(p.pending for p in parts) else sum(
            p.weight * p.value for p in parts if p.value is not None)
        zeroed = tuple(p.name for p in parts if p.name in self._zeroing and (p.value or 0.0) > 0)
        if zeroed and final is not None:
            final = 0.0
        return Scored(t.rollout.id, self.hash, tuple(parts), final, zeroed)

    # -- storing -------------------------------------------------------------------
    def records(self, scored: Scored, previous: Sequence[Reward], *, final: bool,
                outdated: bool = False) -> list[Reward]:
        """The rewards to store for `scored`: the components whose value changed since the last
        scoring under this configuration, the errors, and the final reward (`final` marks it
        final, i.e. for the rollout's final_reward; `outdated`: the rollout's final_reward is not
        this final reward yet and may still move, so it is written even if unchanged)."""
        now, rid, h = time.time(), scored.rollout_id, scored.config_hash
        out = []
        for p in scored.components:
            if p.value is None:
                continue
            last = _latest(previous, p.name, h)
            if last is None or last.value != p.value:
                out.append(Reward(rid, p.value, name=p.name, final=False, created_at=now, config_hash=h,
                                  metadata={"source": p.source, "weight": p.weight, "detail": dict(p.detail)}))
        if scored.errors:
            out.append(Reward(rid, float(len(scored.errors)), name=ERRORS, final=False, created_at=now,
                              config_hash=h, metadata={"errors": scored.errors, "on_error": self.config.on_error}))
        if scored.pending and _latest(previous, PENDING, h) is None:  # once: the marker, not a history
            out.append(Reward(rid, float(len(scored.pending)), name=PENDING, final=False, created_at=now,
                              config_hash=h, metadata={"pending": list(scored.pending), "by": RANKED_BY}))
        if scored.final is not None:
            last = _latest(previous, FINAL, h)
            if out or last is None or last.value != scored.final or (final and outdated):
                out.append(Reward(rid, scored.final, name=FINAL, final=final, created_at=now, config_hash=h,
                                  metadata={"components": scored.values, "weights": self.config.weights,
                                            "absent": [p.name for p in scored.components if p.value is None],
                                            **_notes(scored),
                                            **({"zeroed_by": list(scored.zeroed_by)} if scored.zeroed_by else {})}))
        return out

    def score_rollout(self, store: TraceStore, rollout_id: str, *, status: RolloutStatus | str | None = None,
                      apply: str = "unconsumed", reuse_model: bool = False) -> Written:
        """Score a stored rollout and store the result. `apply`: "unconsumed" (the final reward
        becomes the rollout's final_reward under the store's rule), "none" (stored beside it
        only), "all" (also on a rollout a trainer has taken; the earlier rewards stay)."""
        if apply not in APPLY:
            raise ValueError(f"apply must be one of {', '.join(APPLY)}, got {apply!r}")
        t = load_trajectory(store, rollout_id, status=status)
        return self.store_scored(store, t, apply=apply, reuse_model=reuse_model)

    def store_scored(self, store: TraceStore, t: Trajectory, *, apply: str, reuse_model: bool = False,
                     scored: Scored | None = None) -> Written:
        """Score `t` (or take `scored`, from `score_group`) and store the result."""
        scored = self.score(t, reuse_model=reuse_model) if scored is None else scored
        r = t.rollout
        movable = apply == "all" or (r.claimed_by is None and r.consumed_step is None)
        records = self.records(scored, t.rewards, final=apply != "none",
                               outdated=movable and r.final_reward != scored.final)
        applied = store.add_rewards(records, force_final=apply == "all")
        if scored.pending and not self._hinted:
            self._hinted = True
            log.info("rollout %s waits for its group's ranking before it has a final reward under %s: run %s",
                     t.rollout.id, self.hash, RANKED_BY)
        if scored.final is None and not scored.pending:
            log.warning("rollout %s has no final reward under %s: %s", t.rollout.id, self.hash, scored.errors)
        return Written(scored, len(records), t.rollout.id in applied)


def _notes(scored: Scored) -> dict[str, Any]:
    notes = {p.name: p.note for p in scored.components if p.value is None and p.note and not p.pending}
    return {"notes": notes} if notes else {}
