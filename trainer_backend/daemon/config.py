"""The trainer daemon's configuration (`TrainerConfig`, `GroupPolicy`) and what a step hands on
(`Batch`, `StepResult`). The file format of the same settings is settings.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_middleware import Rollout
from trainer_backend.algorithms import registry
from trainer_backend.daemon.monitoring import HealthConfig
from trainer_backend.daemon.reward_gate import RewardPolicy
from trainer_backend.daemon.validation import EvalPolicy


@dataclass(frozen=True)
class GroupPolicy:
    group_size: int = 8  # rollouts per task that make a full GRPO group
    groups_per_step: int = 16  # a step waits for this many ready groups
    min_group_size: int = 2  # a timed-out group trains only if it has at least this many
    group_timeout_s: float = 300.0  # a group older than this is taken with what it has
    skip_uniform: bool = True  # all rewards equal: zero advantage, no signal -> skip
    statuses: tuple[str, ...] = ("succeeded",)  # finished statuses that train


@dataclass(frozen=True)
class TrainerConfig:
    checkpoint_dir: str
    trainer_id: str = "trainer-0"  # stable across restarts: used to release claims after a crash
    mode: str = "async"  # async | sync
    max_staleness: int = 1  # async: policy versions a rollout may lag
    stale: str = "drop"  # drop | keep
    max_len: int | None = None
    norm_by_std: bool = True  # GRPO std-normalised advantage (False: mean-only, the same as dr_grpo)
    algorithm: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | gspo | ppo | dpo (algorithms/registry.py)
    advantage_level: str = "rollout"  # rollout | sample (each row its own sample: the ablation)
    credit: str = "rollout"  # rollout | per-turn (each call its own advantage: algorithms/advantages.py)
    credit_gamma: float = 1.0  # per-turn: the discount per call
    poll_interval_s: float = 0.5
    keep_checkpoints: int = 3
    success_threshold: float = 1.0  # a rollout succeeded at reward >= this (evaluation's rule too)
    lease_s: float = 60.0  # another daemon may take over this trainer id after this long without a heartbeat
    group: GroupPolicy = field(default_factory=GroupPolicy)
    health: HealthConfig = field(default_factory=HealthConfig)
    eval: EvalPolicy | None = None  # held-out evaluation every N steps, best checkpoint, early stopping
    rewards: RewardPolicy = field(default_factory=RewardPolicy)  # reward version, late components (reward_gate)

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {self.mode!r}")
        if self.stale not in ("drop", "keep"):
            raise ValueError(f"stale must be 'drop' or 'keep', got {self.stale!r}")
        registry.check(self.algorithm)
        if self.advantage_level not in ("rollout", "sample"):
            raise ValueError(f"advantage_level must be 'rollout' or 'sample', got {self.advantage_level!r}")
        registry.check_credit(self.credit, self.algorithm, level=self.advantage_level, gamma=self.credit_gamma)


@dataclass(frozen=True)
class Batch:
    rollouts: tuple[Rollout, ...]
    skipped: dict[str, int]  # reason -> rollouts taken out of the pool without training


@dataclass(frozen=True)
class StepResult:
    step: int
    policy_version: int
    metrics: dict[str, Any]
