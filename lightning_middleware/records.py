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


class _StrEnum(str, enum.Enum):
    """A str enum that prints and formats as its value on every Python version (3.11 changed
    `format()` of mixed-in enums to "Class.MEMBER")."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class RolloutStatus(_StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"


class Mode(_StrEnum):
    TRAIN = "train"
    VAL = "val"


@dataclass(frozen=True)
class Rollout:
    """One run of an agent on one task. Rollouts with the same task_id form a GRPO group."""

    id: str
    task_id: str
    mode: Mode = Mode.TRAIN  # a plain str ("train") is turned into the enum, and checked, on construction
    status: RolloutStatus = RolloutStatus.RUNNING
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

    def __post_init__(self) -> None:
        # Accept the plain strings the store and JSON carry; a bad value fails here, not later.
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "status", RolloutStatus(self.status))


@dataclass(frozen=True)
class Choice:
    """One choice of a response (a request with `n` > 1 has several) with its own tokens.

    `logprobs` are this choice's behaviour logprobs, one per completion token (None when the
    server sent none), so a trainer that trains this choice pairs each token with its own logprob.
    """

    index: int
    completion_token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class LLMCall:
    """One HTTP attempt of one LLM call, as the engine saw it.

    `is_training` is true only for a complete 2xx response carrying token IDs and
    not superseded by a later identical attempt: the trainer reads only those.

    Choice 0 of the response is `completion_token_ids` / `logprobs` / `finish_reason`;
    the other choices of a request with `n` > 1 are `extra_choices`, in index order.
    `choices` is all of them, choice 0 first.

    A call whose caller spoke another format (the Responses API, Anthropic Messages) was sent
    to the engine translated into chat completions: `request` and `response` are the chat
    request and answer the engine saw (so rows, sampling and analysis read it like any chat
    call), `source_format` names the caller's format and `source_request` is what the caller
    sent (`lightning_middleware.formats`).
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
    extra_choices: tuple[Choice, ...] = ()
    source_format: str | None = None  # "responses" | "anthropic.messages"; None: the caller spoke chat
    source_request: dict[str, Any] | None = None
    idempotency_key: str | None = None  # the caller's Idempotency-Key header (the gateway's calls)

    @property
    def has_token_ids(self) -> bool:
        return bool(self.prompt_token_ids) and bool(self.completion_token_ids)

    @property
    def choices(self) -> tuple[Choice, ...]:
        """Every choice with its token IDs: choice 0 (the columns above), then `extra_choices`."""
        first = Choice(0, self.completion_token_ids, self.logprobs, self.finish_reason)
        return (first, *self.extra_choices)

    def choice(self, index: int) -> Choice:
        """The choice with this `index` (0: the columns above); KeyError if the call has none such."""
        for c in self.choices:
            if c.index == index:
                return c
        raise KeyError(f"call {self.id} has no choice {index}")


@dataclass(frozen=True)
class Reward:
    """One reward event of a rollout.

    `final` ones set the rollout's `final_reward` (the number the trainer trains on) while no
    trainer has claimed or consumed the rollout. `call_index` ties a per-step reward to one call
    (turn) of the rollout; such a reward is never final. `config_hash` names the reward
    configuration a component or combined reward was computed under (`lightning_middleware.rewards`);
    None for a reward reported as it is. `agent` names the agent of a multi-agent rollout the
    reward is for (e.g. "reviewer"): a final one is that agent's reward
    (`TraceStore.agent_rewards`) and never moves the rollout's `final_reward`.
    """

    rollout_id: str
    value: float
    name: str | None = None
    final: bool = True
    created_at: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    id: int | None = None
    call_index: int | None = None
    config_hash: str | None = None
    agent: str | None = None

    def __post_init__(self) -> None:
        if self.call_index is not None and self.final:
            raise ValueError("a per-step reward (call_index set) cannot be final: pass final=False")
        if self.agent is not None and (not isinstance(self.agent, str) or not self.agent or len(self.agent) > 128):
            raise ValueError(f"a reward's agent must be a non-empty name of at most 128 characters, got {self.agent!r}")

    @property
    def sets_final_reward(self) -> bool:
        """Whether this reward is a candidate for the rollout's `final_reward` (a rollout-level final one)."""
        return self.final and self.agent is None


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    path: str | None = None
    trainer_id: str | None = None
    checksum: str | None = None
    created_at: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


# The metrics every trainer step records in `TrainStep.metrics` (the daemon writes more:
# rows_*, skipped_*, publish_*). Notebooks and analysis read these names; a daemon test checks
# that a real step writes every one of them.
STEP_METRICS: dict[str, str] = {
    "loss": "the step's loss (policy loss + KL/entropy terms), rollout-level token mean",
    "pg_loss": "the clipped policy-gradient part of the loss",
    "approx_kl": "mean(old - new log-prob) over response tokens (verl's ppo_kl)",
    "entropy": "mean token entropy of the policy, aggregated like the loss",
    "clip_frac": "share of response tokens whose ratio was clipped",
    "ratio_max": "largest new/old probability ratio of any response token",
    "grad_norm": "gradient norm before clipping",
    "lr": "learning rate of the step's update",
    "reward_mean": "mean final reward of the step's rollouts",
    "reward_std": "standard deviation of those rewards",
    "success_rate": "share of the step's rollouts that succeeded",
    "staleness_mean": "mean policy-version lag of the step's rollouts",
    "staleness_max": "largest policy-version lag",
    "n_rollouts": "rollouts trained in the step",
    "tokens_per_s": "training tokens per second of the engine step",
    "batch_build_s": "time to read the step's calls and build its rows and advantages",
    "save_s": "time to write the step's checkpoint",
    "step_time_s": "wall time of the whole step (batch, train, publish, commit)",
    "rows_prefix_break_rate": "share of merge chances where a prompt did not extend its row",
}


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


# The event a confined rollout's attempt to get out leaves (data: rollout_id, class, and what it
# tried), written by the sandboxed backend's door or by the gateway for a rollout-scoped token.
SANDBOX_BREACH = "sandbox_breach"


@dataclass(frozen=True)
class Event:
    """Something a component noticed, e.g. a trainer health check ("entropy_collapse")."""

    kind: str
    message: str
    source: str | None = None  # e.g. the trainer id
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    id: int | None = None
