"""The algorithms behind `--algo` and what each asks of the daemon and the engine.

    name          advantages                              loss / engine
    grpo          group-normalised outcome (advantages)   PPO clipped surrogate, token ratio
    dr_grpo       R - group mean                          same
    rloo          leave-one-out baseline                  same
    reinforce_pp  group baseline, whitened over tokens    same
    gspo          as grpo                                 sequence-level ratio, seq-mean-token-mean
    ppo           GAE from a critic (algorithms/ppo.py)   same surrogate + the critic's value loss
    dpo           best vs worst rollout per group         DPO against the frozen reference (dpo.py)

Light (no torch): the daemon's config and the CLI validate names with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_middleware.records import Rollout
from lightning_middleware.rows import Row

OUTCOME = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo")
ALGORITHMS = (*OUTCOME, "ppo", "dpo")


def check(name: str) -> str:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; one of {', '.join(ALGORITHMS)}")
    return name


def trains_uniform_groups(name: str) -> bool:
    """PPO learns from a group whose rewards are all equal (its critic's baseline is not the
    group's); the group-relative algorithms and DPO get no signal from one."""
    return check(name) == "ppo"


def label_rows(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], *, level: str = "rollout"
               ) -> tuple[list[Row], list[float]]:
    """The rows to train and each one's advantage (DPO: its +1/-1 label; PPO: 0, the engine's
    critic computes them)."""
    check(name)
    if name == "ppo":
        return list(rows), [0.0] * len(rows)
    if name == "dpo":
        from trainer_backend.algorithms.dpo import pairs_from_groups, preference_advantages

        have = {r.rollout_id for r in rows}
        pairs = [p for p in pairs_from_groups(rollouts) if p.chosen in have and p.rejected in have]
        labels: Mapping[str, float] = preference_advantages(pairs)
        kept = [r for r in rows if r.rollout_id in labels]
        return kept, [labels[r.rollout_id] for r in kept]
    from trainer_backend.algorithms.advantages import advantages_for

    return list(rows), advantages_for(name, rollouts, rows, level=level)
