"""Advantages for a batch: one policy, or each policy of a team on its own rows.

With one policy the batch is labelled as a whole (groups are tasks). With separate policies
per agent each policy is labelled on its own rows, so its groups are (task, policy): the
rollouts of one task in which that policy acted, rewarded with the rollout's reward. An agent
with its own rewards (`emit_reward(v, agent=...)`) is its own group within its policy: its
rows are labelled with its reward against the same agent in the other rollouts of the task.
So a rollout-level reward applies to every policy that acted in the rollout unless a
per-agent reward exists, and one policy playing two rewarded roles (a shared policy) keeps
each role's baseline apart.

With per-turn credit (`credit`, algorithms/credit.py) the same sets of rows are labelled, each
call by its own return: the per-step rewards of the calls in that set and the set's reward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from lightning_middleware.records import Rollout
from lightning_middleware.rows import Row, with_advantages
from trainer_backend.algorithms import credit as per_turn
from trainer_backend.algorithms import registry


def label(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], *, level: str = "rollout",
          parts: Mapping[str, Sequence[Row]] | None = None,
          agent_rewards: Mapping[str, Mapping[str, float]] | None = None,
          credit: per_turn.StepRewards | None = None) -> list[Row]:
    """The rows to train with their advantages (and `reward`) set.

    `parts` splits the rows by policy (`RoutesRows.route`); None labels them as one policy.
    `agent_rewards` is rollout id -> agent name -> reward (the store's per-agent rewards).
    `credit`: per-turn credit from these per-step rewards; None: rollout-level."""
    if parts is None:
        return _label_one(name, rollouts, rows, level, credit)
    rewarded = {agent for given in (agent_rewards or {}).values() for agent in given}
    out: list[Row] = []
    for policy_rows in parts.values():
        for agent, agent_rows in _by_rewarded_agent(policy_rows, rewarded).items():
            out.extend(_label_one(name, policy_rollouts(rollouts, agent_rows, agent, agent_rewards or {}),
                                  agent_rows, level, credit))
    return out


def policy_rollouts(rollouts: Sequence[Rollout], rows: Sequence[Row], agent: str | None,
                    agent_rewards: Mapping[str, Mapping[str, float]]) -> list[Rollout]:
    """The rollouts `rows` come from, each with the reward they are trained on as `final_reward`:
    `agent`'s own reward where it has one, else the rollout's."""
    ids = {row.rollout_id for row in rows}
    out = []
    for r in rollouts:
        if r.id not in ids:
            continue
        given = agent_rewards.get(r.id, {})
        out.append(dataclasses.replace(r, final_reward=given[agent]) if agent is not None and agent in given else r)
    return out


def _by_rewarded_agent(rows: Sequence[Row], rewarded: set[str]) -> dict[str | None, list[Row]]:
    """A policy's rows: those of each agent with its own rewards apart, the rest together (None)."""
    out: dict[str | None, list[Row]] = {}
    for row in rows:
        out.setdefault(row.agent if row.agent in rewarded else None, []).append(row)
    return out


def _label_one(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], level: str,
               credit: per_turn.StepRewards | None) -> list[Row]:
    if credit is not None:
        return per_turn.label(name, rollouts, rows, credit)
    kept, adv = registry.label_rows(name, rollouts, rows, level=level)
    return with_advantages(kept, adv, rewards={r.id: float(r.final_reward or 0.0) for r in rollouts})
