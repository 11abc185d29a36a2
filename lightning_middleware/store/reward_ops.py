"""The store's reward writes and reads beyond one rollout's list: several rewards in one
transaction, the rule for when a final reward moves `rollouts.final_reward`, per-step rewards.

The rule: a final reward sets the rollout's `final_reward` only while no trainer has claimed or
consumed the rollout. After that the reward is still stored (nothing is thrown away) but the
number the trainer trained on stays the rollout's final reward; `force` (re-scoring with
`--apply all`) overrides that, and the earlier rewards stay in the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import sqlalchemy as sa

from lightning_middleware.records import Reward
from lightning_middleware.store import mapping as M
from lightning_middleware.store import schema as S


def set_final_reward(conn: sa.Connection, rollout_id: str, value: float, *, force: bool = False) -> bool:
    """Set `rollouts.final_reward` under the rule above; True if the row changed."""
    c = S.rollouts.c
    q = sa.update(S.rollouts).where(c.id == rollout_id)
    if not force:
        q = q.where(c.claimed_by.is_(None), c.consumed_step.is_(None))
    return conn.execute(q.values(final_reward=float(value))).rowcount == 1


class RewardOps:
    """Reward methods of `TraceStore` (a mixin over `self.engine`)."""

    engine: sa.Engine

    def add_rewards(self, rewards: Sequence[Reward], *, force_final: bool = False) -> set[str]:
        """Store `rewards` in one transaction; the last final reward of each rollout sets its
        final reward under the rule above. Returns the rollouts whose final reward it set."""
        if not rewards:
            return set()
        finals = {r.rollout_id: r.value for r in rewards if r.sets_final_reward}
        with self.engine.begin() as conn:
            conn.execute(sa.insert(S.rewards), [M.reward_row(r) for r in rewards])
            return {rid for rid, value in finals.items() if set_final_reward(conn, rid, value, force=force_final)}

    def add_reward(self, reward: Reward) -> bool:
        """Store one reward; True if it set the rollout's final reward (see the rule above)."""
        return bool(self.add_rewards([reward]))

    def rewards_for(self, rollout_ids: Iterable[str]) -> dict[str, list[Reward]]:
        """The rewards of many rollouts in one query, oldest first, keyed by rollout id."""
        ids = list(dict.fromkeys(rollout_ids))
        out: dict[str, list[Reward]] = {rid: [] for rid in ids}
        if not ids:
            return out
        t = S.rewards
        q = sa.select(t).where(t.c.rollout_id.in_(ids)).order_by(t.c.id)
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                reward = M.reward_record(row)
                out[reward.rollout_id].append(reward)
        return out

    def agent_rewards(self, rollout_ids: Iterable[str]) -> dict[str, dict[str, float]]:
        """Per rollout, agent name -> its latest final per-agent reward (rollouts without any: {}).
        What a multi-policy trainer trains each agent's policy on."""
        ids = list(dict.fromkeys(rollout_ids))
        out: dict[str, dict[str, float]] = {rid: {} for rid in ids}
        if not ids:
            return out
        t = S.rewards
        q = (sa.select(t.c.rollout_id, t.c.agent, t.c.value)
             .where(t.c.rollout_id.in_(ids), t.c.agent.is_not(None), t.c.final.is_(True)).order_by(t.c.id))
        with self.engine.connect() as conn:
            for rid, agent, value in conn.execute(q):
                out[rid][agent] = float(value)  # ordered by id: the latest wins
        return out

    def step_rewards(self, rollout_ids: Iterable[str]) -> dict[str, dict[int, float]]:
        """Per rollout, the per-step rewards summed by call index (rollouts without any: {})."""
        out: dict[str, dict[int, float]] = {}
        for rid, rewards in self.rewards_for(rollout_ids).items():
            steps: dict[int, float] = {}
            for r in rewards:
                if r.call_index is not None:
                    steps[r.call_index] = steps.get(r.call_index, 0.0) + r.value
            out[rid] = steps
        return out
