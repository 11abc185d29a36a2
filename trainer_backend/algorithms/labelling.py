"""Advantages for a batch: one policy, or each policy of a team on its own rows.

With one policy the batch is labelled as a whole (groups are tasks). With separate policies
per agent each policy is labelled on its own rows, so its groups are (task, policy): the
rollouts of one task in which that policy acted. The reward a policy sees for a rollout is
the per-agent reward of its agents in that rollout (their mean, if one policy plays several
agents that were rewarded), else the rollout's reward: a rollout-level reward applies to every
policy that acted in it unless a per-agent reward exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from lightning_middleware.records import Rollout
from lightning_middleware.rows import Row, with_advantages
from trainer_backend.algorithms import registry


def label(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], *, level: str = "rollout",
          parts: Mapping[str, Sequence[Row]] | None = None,
          agent_rewards: Mapping[str, Mapping[str, float]] | None = None) -> list[Row]:
    """The rows to train with their advantages (and `reward`) set.

    `parts` splits the rows by policy (`RoutesRows.route`); None labels them as one policy.
    `agent_rewards` is rollout id -> agent name -> reward (the store's per-agent rewards)."""
    if parts is None:
        return _label_one(name, rollouts, rows, level)
    out: list[Row] = []
    for policy_rows in parts.values():
        out.extend(_label_one(name, policy_rollouts(rollouts, policy_rows, agent_rewards or {}),
                              policy_rows, level))
    return out


def policy_rollouts(rollouts: Sequence[Rollout], rows: Sequence[Row],
                    agent_rewards: Mapping[str, Mapping[str, float]]) -> list[Rollout]:
    """The rollouts in which one policy acted (`rows` are its rows), each with the reward that
    policy is trained on as `final_reward`."""
    agents: dict[str, set[str]] = {}
    for row in rows:
        agents.setdefault(row.rollout_id, set()).add(row.agent or "")
    out = []
    for r in rollouts:
        if r.id not in agents:
            continue
        given = agent_rewards.get(r.id, {})
        values = [given[a] for a in sorted(agents[r.id]) if a in given]
        out.append(dataclasses.replace(r, final_reward=sum(values) / len(values)) if values else r)
    return out


def _label_one(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], level: str) -> list[Row]:
    kept, adv = registry.label_rows(name, rollouts, rows, level=level)
    return with_advantages(kept, adv, rewards={r.id: float(r.final_reward or 0.0) for r in rollouts})
