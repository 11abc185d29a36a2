"""What the trainer takes from the rewards table beyond `rollouts.final_reward`: which reward
version to train on, which components to wait for, and the per-step hacking rate.

- `version`: a reward configuration's hash (`lightning-mw rewards check`, `rescore`). The daemon
  trains on the latest final reward stored under it (a rescore's new version), not on
  `final_reward`; a rollout without one is skipped, counted as `no_reward_version`.
- `wait_for`: component -> seconds after the rollout ended. A group with a member that lacks
  one of them (a human label, a judge's late score) is left in the pool until the component
  arrives (it is then used: the late reward is combined into the final one) or its deadline
  passes; then `on_deadline` trains without it ("train_without", counted per step as
  `rewards_trained_without_<name>`) or skips the rollout ("skip", counted as
  `skipped_late_<name>`). `rewards_waiting` is how many rollouts were waiting at the step.
- `config`: a reward configuration (a `RewardConfig` or its file): a ready group with a member
  that has no final reward (nor ranking) under it is scored by the daemon just before it
  trains, a ranking judge (`[rank_judge]`) ranking the group once (rollouts scored as they end
  have no group yet: their final reward waits for this). The daemon trains on that
  configuration's version. Per step: `rank_judge_groups` (ranked), `rank_judge_failed` (no
  ranking: the judge failed or its answers were never readable; with on_error "drop" those
  rollouts are skipped, counted as `rank_judge_failed`), `rank_judge_groups_of_one`,
  `rank_judge_unparseable` (answers that could not be read, retried or not).
- Guards: every stored guard verdict (a component whose source is "guard") of the batch gives
  `guard_<name>_rate` (rollouts where it fired) and `hacking_rate` (any guard fired).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from lightning_middleware import Reward, RewardConfig, Rollout, TraceStore
from lightning_middleware.rewards import Scorer
from lightning_middleware.rewards.config import RANK_JUDGE
from lightning_middleware.rewards.trajectory import load_trajectories

ON_DEADLINE = ("train_without", "skip")
FINAL = "final"  # the combined reward's name (lightning_middleware.rewards.combine)


@dataclass(frozen=True)
class RewardPolicy:
    version: str | None = None
    wait_for: Mapping[str, float] = field(default_factory=dict)
    on_deadline: str = "train_without"
    config: RewardConfig | str | Path | None = None  # scores ready groups (its ranking judge) before training

    def __post_init__(self) -> None:
        if self.on_deadline not in ON_DEADLINE:
            raise ValueError(f"on_deadline must be one of {', '.join(ON_DEADLINE)}, got {self.on_deadline!r}")
        bad = {k: v for k, v in self.wait_for.items() if not isinstance(v, (int, float)) or v < 0}
        if bad:
            raise ValueError(f"wait_for deadlines must be seconds >= 0, got {bad}")

    @property
    def reads_rewards(self) -> bool:
        return self.version is not None or bool(self.wait_for) or self.config is not None


class RewardGate:
    """Applies a `RewardPolicy` to the daemon's groups (one rewards query per group)."""

    def __init__(self, store: TraceStore, policy: RewardPolicy) -> None:
        self.store = store
        self.scorer = _group_scorer(policy)
        if self.scorer is not None:  # train on the version the daemon scores
            if policy.version not in (None, self.scorer.hash):
                raise ValueError(f"rewards.version {policy.version} is not the hash of rewards.config "
                                 f"({self.scorer.hash}): give one of them")
            policy = replace(policy, version=self.scorer.hash)
        self.policy = policy
        self._ranking: Counter[str] = Counter()  # the ranking judge's counts since the last step
        self.reasons: dict[str, str] = {}  # rollout id -> why it has no reward to train on
        self._without: dict[str, list[str]] = {}  # rollout id -> components it trains without
        self._waiting: set[str] = set()

    def _counts(self, r: Reward) -> bool:
        """Whether a stored reward is of the version trained on (a person's or the agent's always are)."""
        return self.policy.version is None or r.config_hash in (None, self.policy.version)

    def review(self, members: Sequence[Rollout], now: float | None = None) -> list[Rollout] | None:
        """The group as the trainer should see it (final rewards of the version; rollouts skipped
        at a deadline have none, their reason in `reasons`), or None while it waits."""
        if not self.policy.reads_rewards:
            return list(members)
        now = time.time() if now is None else now
        stored: Mapping[str, Sequence[Reward]] = self.store.rewards_for([r.id for r in members])
        late_by_id: dict[str, list[str]] = {}
        for r in members:
            rewards = [x for x in stored.get(r.id, []) if self._counts(x)]
            missing = [n for n in self.policy.wait_for if not any(x.name == n for x in rewards)]
            late = [n for n in missing if now - (r.ended_at or r.created_at) > self.policy.wait_for[n]]
            if len(late) < len(missing):
                self._waiting.add(r.id)
            else:
                self._waiting.discard(r.id)
                late_by_id[r.id] = late
        if len(late_by_id) < len(members):
            return None
        if self._unscored(members, stored):
            members, stored = self._rank(members)
        out = []
        for r in members:
            rewards = [x for x in stored.get(r.id, []) if self._counts(x)]
            late = late_by_id[r.id]
            r = self._versioned(r, rewards)
            if late and self.policy.on_deadline == "skip":
                self.reasons[r.id] = f"late_{late[0]}"
                r = replace(r, final_reward=None)
            else:
                self._without[r.id] = late
            out.append(r)
        return out

    def _unscored(self, members: Sequence[Rollout], stored: Mapping[str, Sequence[Reward]]) -> bool:
        """A member has neither a final reward of the configuration nor its ranking judge's value."""
        if self.scorer is None:
            return False
        h = self.scorer.hash
        return any(not any(x.config_hash == h and x.name in (RANK_JUDGE, FINAL) for x in stored.get(r.id, []))
                   for r in members)

    def _rank(self, members: Sequence[Rollout]) -> tuple[list[Rollout], Mapping[str, Sequence[Reward]]]:
        """Score the group under the configuration (a ranking judge ranks it once); the members as stored now."""
        assert self.scorer is not None
        trajectories = load_trajectories(self.store, members)
        scored, ranking = self.scorer.score_group(trajectories)
        for t, one in zip(trajectories, scored):
            self.scorer.store_scored(self.store, t, apply="unconsumed", scored=one)
        if ranking is not None:
            self._ranking.update(groups=bool(ranking.values), failed=ranking.error is not None,
                                 groups_of_one=ranking.note is not None, unparseable=ranking.unparseable)
            if ranking.error is not None:
                self.reasons.update({r.id: "rank_judge_failed" for r in members})
        fresh = [self.store.get_rollout(r.id) or r for r in members]
        return fresh, self.store.rewards_for([r.id for r in members])

    def _versioned(self, r: Rollout, rewards: Sequence[Reward]) -> Rollout:
        if self.policy.version is None:
            return r
        finals = [x for x in rewards if x.name == FINAL and x.config_hash == self.policy.version]
        if not finals:
            self.reasons.setdefault(r.id, "no_reward_version")  # unless the ranking judge failed on it
            return replace(r, final_reward=None)
        return replace(r, final_reward=finals[-1].value)

    def step_metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """The batch's guard rates, the components trained without, the rollouts waiting."""
        stored = self.store.rewards_for([r.id for r in rollouts])
        fired: Counter[str] = Counter()
        names: set[str] = set()
        hacked = 0
        for r in rollouts:
            latest: dict[str, float] = {}
            for x in stored.get(r.id, []):
                if x.config_hash is not None and self._counts(x) and (x.metadata or {}).get("source") == "guard":
                    latest[str(x.name)] = x.value
            names.update(latest)
            hits = [n for n, v in latest.items() if v > 0]
            fired.update(hits)
            hacked += bool(hits)
        out: dict[str, float] = {}
        if names:
            out["hacking_rate"] = hacked / len(rollouts)
            out.update({f"guard_{n}_rate": fired[n] / len(rollouts) for n in sorted(names)})
        without = Counter(n for r in rollouts for n in self._without.pop(r.id, []))
        out.update({f"rewards_trained_without_{n}": float(k) for n, k in without.items()})
        if self.policy.wait_for:
            out["rewards_waiting"] = float(len(self._waiting))
        if self.scorer is not None and self.scorer.config.rank_judge is not None:
            out.update({f"rank_judge_{k}": float(self._ranking[k])
                        for k in ("groups", "failed", "groups_of_one", "unparseable")})
            self._ranking.clear()
        for r in rollouts:
            self.reasons.pop(r.id, None)
        return out


def _group_scorer(policy: RewardPolicy) -> Scorer | None:
    if policy.config is None:
        return None
    config = policy.config if isinstance(policy.config, RewardConfig) else RewardConfig.load(policy.config)
    return Scorer(config)
