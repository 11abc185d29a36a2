"""Rewards: rule, reward-model and human-feedback components combined by weight into the final
reward, reward-hacking guards, per-step rewards, re-scoring stored rollouts, a labelling page.

    config = RewardConfig.load("rewards.toml")      # or RewardConfig.from_dict({...})
    with rollout("task-7", rewards=config) as r:    # scored as it ends
        ...
    rescore(store, config)                          # or: lightning-mw rewards rescore

`config` (the configuration and its hash), `trajectory` (a rollout as reward functions see it),
`rules` (rule rewards and the built-ins), `guards` (reward-hacking penalties), `sources` (the
reward model, human labels, calibration), `ranking` (the judge that ranks a group's rollouts),
`combine` (scoring and storing: `Scorer`), `rescore`,
`steps` (per-step rewards as token-level rewards), `review` (the labelling page's app, on
`lightning_middleware.asgi`), `cli`.
docs/rewards.md has the format and the rules.
"""

from lightning_middleware.rewards.combine import ComponentValue, Scored, Scorer, Written
from lightning_middleware.rewards.config import (
    Component,
    ConfigError,
    HumanConfig,
    RankJudgeConfig,
    RewardConfig,
    RewardModelConfig,
    load_config,
)
from lightning_middleware.rewards.guards import BUILTIN_GUARDS
from lightning_middleware.rewards.protect import ProtectedFiles
from lightning_middleware.rewards.ranking import GroupRanking, RankParseError, parse_ranking
from lightning_middleware.rewards.rescore import RescoreReport, calibration, rescore
from lightning_middleware.rewards.rules import BUILTIN_RULES, Score
from lightning_middleware.rewards.sources import Calibration, RewardModelError, wants_label
from lightning_middleware.rewards.steps import token_rewards
from lightning_middleware.rewards.trajectory import ToolCall, ToolResult, Trajectory, load_trajectory

__all__ = [
    "BUILTIN_GUARDS",
    "BUILTIN_RULES",
    "Calibration",
    "Component",
    "ComponentValue",
    "ConfigError",
    "GroupRanking",
    "HumanConfig",
    "ProtectedFiles",
    "RankJudgeConfig",
    "RankParseError",
    "RescoreReport",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelError",
    "Score",
    "Scored",
    "Scorer",
    "ToolCall",
    "ToolResult",
    "Trajectory",
    "Written",
    "calibration",
    "load_config",
    "load_trajectory",
    "parse_ranking",
    "rescore",
    "token_rewards",
    "wants_label",
]
