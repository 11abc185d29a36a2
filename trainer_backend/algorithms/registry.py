"""The names behind `--algo`, `credit` and `advantage_level`, and what each asks of the daemon and
the engine: the one table the configuration, the CLI and the daemon read.

    name          advantages (advantages.py)              loss (losses.py)
    grpo          group-normalised outcome                PPO clipped surrogate, token ratio
    dr_grpo       R - group mean                          same
    rloo          leave-one-out baseline                  same
    reinforce_pp  group baseline, whitened over tokens    same
    gspo          as grpo                                 sequence-level ratio, seq-mean-token-mean
    ppo           GAE from a critic                       same surrogate + the critic's value loss
    dpo           best vs worst rollout per group         DPO against the frozen reference

Light (no torch): the daemon's config and the CLI validate names with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """What `--algo NAME` means to the daemon and the engine."""

    name: str
    # "outcome": one advantage per sample from its reward, by `advantages.ESTIMATORS[name]`;
    # "critic": GAE from PPO's value model; "pairs": DPO's +1 / -1 labels of a group's best and worst.
    advantage: str
    loss: str = "surrogate"  # "surrogate": PPO's clipped surrogate (losses.policy_loss); "dpo"
    ratio_level: str = "token"  # the surrogate's ratio: per token, or GSPO's per sequence
    agg: str | None = None  # the loss aggregation it defaults to (None: the configured one)

    @property
    def trains_uniform_groups(self) -> bool:
        """PPO learns from a group whose rewards are all equal (its critic's baseline is not the
        group's); the group-relative algorithms and DPO get no signal from one."""
        return self.advantage == "critic"

    @property
    def per_turn(self) -> bool:
        """Per-turn credit needs per-token advantages; DPO compares whole rollouts."""
        return self.advantage != "pairs"


TABLE: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("grpo", "outcome"),
    Algorithm("dr_grpo", "outcome"),
    Algorithm("rloo", "outcome"),
    Algorithm("reinforce_pp", "outcome"),
    Algorithm("gspo", "outcome", ratio_level="sequence", agg="seq-mean-token-mean"),
    Algorithm("ppo", "critic"),
    Algorithm("dpo", "pairs", loss="dpo"),
)}
ALGORITHMS = tuple(TABLE)
OUTCOME = tuple(n for n, a in TABLE.items() if a.advantage == "outcome")
PER_TURN_ALGORITHMS = tuple(n for n, a in TABLE.items() if a.per_turn)
CREDITS = ("rollout", "per-turn")
ADVANTAGE_LEVELS = ("rollout", "sample")


def get(name: str) -> Algorithm:
    if name not in TABLE:
        raise ValueError(f"unknown algorithm {name!r}; one of {', '.join(ALGORITHMS)}")
    return TABLE[name]


def check(name: str) -> str:
    return get(name).name


def trains_uniform_groups(name: str) -> bool:
    return get(name).trains_uniform_groups


def check_credit(credit: str, algorithm: str, *, level: str = "rollout", gamma: float = 1.0,
                 kl_in_reward: bool = False) -> str:
    """The credit mode, if it goes with the rest of the configuration; else a ValueError saying why."""
    if credit not in CREDITS:
        raise ValueError(f"credit must be one of {', '.join(CREDITS)}, not {credit!r}")
    if not 0 < gamma <= 1:
        raise ValueError(f"credit_gamma must be in (0, 1], got {gamma}")
    if credit == "rollout":
        if gamma != 1:
            raise ValueError("credit_gamma discounts per-turn returns: it needs credit = 'per-turn'")
        return credit
    check(algorithm)
    if algorithm not in PER_TURN_ALGORITHMS:
        raise ValueError(f"credit 'per-turn' needs per-token advantages ({', '.join(PER_TURN_ALGORITHMS)}); "
                         f"{algorithm!r} compares whole rollouts: use credit 'rollout'")
    if level != "rollout":
        raise ValueError("credit 'per-turn' makes every call a sample; advantage_level 'sample' (every row) "
                         "is another view: keep advantage_level 'rollout'")
    if algorithm == "ppo" and gamma != 1:
        raise ValueError("with ppo, GAE discounts the per-step rewards per token (critic.gamma): "
                         "leave credit_gamma at 1")
    if kl_in_reward and algorithm != "ppo":
        raise ValueError(f"credit 'per-turn' with the KL in the reward runs with ppo only; "
                         f"with {algorithm!r} put the KL in the loss (loss.kl_in = 'loss')")
    return credit
