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
- Guards: every stored guard verdict (a component whose source is "guard") of the batch gives
  `guard_<name>_rate` (rollouts where it fired) and `hacking_rate` (any guard fired).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from lightning_middleware import Reward, Rollout, TraceStore

ON_DEADLINE = ("train_without", "skip")
FINAL = "final"  # the combined reward's name (lightning_middleware.rewards.combine)


@dataclass(frozen=True)
class RewardPolicy:
    version: str | None = None
    wait_for: Mapping[str, float] = field(default_factory=dict)
    on_deadline: str = "train_without"

    def __post_init__(self) -> None:
        if self.on_deadline not in ON_DEADLINE:
            raise ValueError(f"on_deadline must be one of {', '.join(ON_DEADLINE)}, got {self.on_deadline!r}")
        bad = {k: v for k, v in self.wait_for.items() if not isinstance(v, (int, float)) or v < 0}
        if bad:
            raise ValueError(f"wait_for deadlines must be seconds >= 0, got {bad}")

    @property
    def reads_rewards(self) -> bool:
        return self.version is not None or bool(self.wait_for)


class RewardGate:
    """Applies a `RewardPolicy` to the daemon's groups (one rewards query per group)."""

    def __init__(self, store: TraceStore, policy: RewardPolicy) -> None:
        self.store = store
        self.policy = policy
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
        stored = self.store.rewards_for([r.id for r in members])
        out, waiting = [], False
        for r in members:
            rewards = [x for x in stored.get(r.id, []) if self._counts(x)]
            missing = [n for n in self.policy.wait_for if not any(x.name == n for x in rewards)]
            late = [n for n in missing if now - (r.ended_at or r.created_at) > self.policy.wait_for[n]]
            if len(late) < len(missing):
                waiting = True
                self._waiting.add(r.id)
                continue
            self._waiting.discard(r.id)
            r = self._versioned(r, rewards)
            if late and self.policy.on_deadline == "skip":
                self.reasons[r.id] = f"late_{late[0]}"
                r = replace(r, final_reward=None)
            else:
                self._without[r.id] = late
            out.append(r)
        return None if waiting else out

    def _versioned(self, r: Rollout, rewards: Sequence[Reward]) -> Rollout:
        if self.policy.version is None:
            return r
        finals = [x for x in rewards if x.name == FINAL and x.config_hash == self.policy.version]
        if not finals:
            self.reasons[r.id] = "no_reward_version"
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
        for r in rollouts:
            self.reasons.pop(r.id, None)
        return out
