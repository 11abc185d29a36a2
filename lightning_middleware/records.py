"""The records the store holds, as frozen dataclasses.

These are what readers get back (the trainer, notebooks, the CLI). Writers build
them too; the store turns them into rows. Token IDs and logprobs are tuples so a
record can be hashed and shared between threads without copies going stale.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any


def new_id() -> str:
    """A 32-hex-digit id that sorts by creation time.

    Time-ordered keys append at the right edge of the primary-key B-tree instead
    of landing at random pages (as uuid4 does), which keeps bulk ingestion fast
    on both SQLite and PostgreSQL.
    """
    return f"{time.time_ns():016x}{os.urandom(8).hex()}"


class RolloutStatus(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"


class Mode(str, enum.Enum):
    TRAIN = "train"
    VAL = "val"


@dataclass(frozen=True)
class Rollout:
    """One run of an agent on one task. Rollouts with the same task_id form a GRPO group."""

    id: str
    task_id: str
    mode: str = "train"
    status: str = RolloutStatus.RUNNING.value
    input: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    final_reward: float | None = None
    policy_version: int | None = None
    created_at: float = 0.0
    ended_at: float | None = None
    duration_s: float | None = None
    error: str | None = None
    # Set by the trainer: which daemon took it, and the step that trained on it.
    claimed_by: str | None = None
    consumed_step: int | None = None


@dataclass(frozen=True)
class LLMCall:
    """One HTTP attempt of one LLM call, as the engine saw it.

    `is_training` is true only for a complete 2xx response carrying token IDs and
    not superseded by a later identical attempt: the trainer reads only those.
    """

    id: str
    rollout_id: str | None
    call_index: int
    attempt: int = 1
    endpoint: str = "chat.completions"  # chat.completions | completions | responses | other
    model: str | None = None
    agent_name: str | None = None
    request: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] | None = None
    prompt_token_ids: tuple[int, ...] = ()
    completion_token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    finish_reason: str | None = None
    status_code: int | None = None
    stream: bool = False
    partial: bool = False
    is_training: bool = False
    error: str | None = None
    latency_s: float | None = None
    started_at: float = 0.0
    policy_version: int | None = None
    request_hash: str | None = None

    @property
    def has_token_ids(self) -> bool:
        return bool(self.prompt_token_ids) and bool(self.completion_token_ids)


@dataclass(frozen=True)
class Reward:
    rollout_id: str
    value: float
    name: str | None = None
    final: bool = True
    created_at: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    id: int | None = None


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    path: str | None = None
    trainer_id: str | None = None
    checksum: str | None = None
    created_at: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainStep:
    step: int
    policy_version: int | None = None
    created_at: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    rollout_ids: tuple[str, ...] = ()
    trainer_id: str | None = None


@dataclass(frozen=True)
class EvalResult:
    """One evaluation of a held-out task set (see evaluation.py for the metrics)."""

    name: str = "val"
    step: int | None = None
    policy_version: int | None = None
    created_at: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    rollout_ids: tuple[str, ...] = ()
    id: int | None = None
