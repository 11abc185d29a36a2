"""What the controller schedules and what comes back: jobs, outcomes, results, the retry policy."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.records import Mode
from lightning_middleware.rewards import RewardConfig


class WorkerLost(RuntimeError):
    """The process (or Ray actor) running a rollout died before reporting back."""


class SandboxBreach(RuntimeError):
    """A sandboxed rollout tried what its sandbox forbids (controller/sandbox.py): the rollout's own
    failure, never retried. `kind` is the class recorded with it."""

    kind = "sandbox"


class SandboxNetwork(SandboxBreach):
    """A connection other than the rollout's door, or a gateway route outside its own rollout."""

    kind = "sandbox_network"


class SandboxFiles(SandboxBreach):
    """A read or write outside the rollout's work directory."""

    kind = "sandbox_fs"


class SandboxLimit(SandboxBreach):
    """Past a limit: memory, CPU time, processes, or the wall-clock deadline."""

    kind = "sandbox_limit"


class SandboxReward(SandboxBreach):
    """A reward the rollout sent itself where the reward configuration forbids it."""

    kind = "sandbox_reward"


BREACHES: dict[str, type[SandboxBreach]] = {c.kind: c for c in (SandboxNetwork, SandboxFiles, SandboxLimit,
                                                                  SandboxReward)}
_BREACH_TYPE = f"{SandboxBreach.__module__}.{SandboxBreach.__qualname__}"


def breach_in(error_types: Sequence[str]) -> type[SandboxBreach] | None:
    """The breach class an outcome's error types name (an outcome's `error_types`), or None."""
    if _BREACH_TYPE not in error_types:
        return None
    return next((c for c in BREACHES.values() if type_names(c)[0] in error_types), None)


DEFAULT_RETRY_ON: tuple[str, ...] = (
    "ConnectionError",  # builtins: refused/reset connections
    "openai.APIConnectionError",  # includes APITimeoutError
    "httpx.TransportError",
    "httpx2.TransportError",
    "lightning_middleware.controller.jobs.WorkerLost",
)


def type_names(exc_type: type) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in exc_type.__mro__ if c not in (object, BaseException)]


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a rollout (as a new rollout of the same sample) when it raised an infrastructure error.

    `retry_on` holds exception types or names: "ConnectionError" (a builtin),
    "openai.APIConnectionError" (package + class name) or a full
    "module.Class". A subclass matches. Only exceptions retry: a rollout that
    returned a low reward is a result, not an error.
    """

    max_attempts: int = 3
    retry_on: tuple[type[BaseException] | str, ...] = DEFAULT_RETRY_ON
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def matches(self, error_types: Sequence[str]) -> bool:
        """True if an exception with these "module.Class" MRO names should be retried; a sandbox
        breach never is (a retry would run the same attack again)."""
        if _BREACH_TYPE in error_types:
            return False
        for want in self.retry_on:
            name = f"{want.__module__}.{want.__qualname__}" if isinstance(want, type) else want
            if any(_name_match(name, have) for have in error_types):
                return True
        return False

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2 ** (attempt - 1))) * (0.5 + random.random() / 2)


def _name_match(want: str, have: str) -> bool:
    """`have` is "module.Qualname"; `want` is "Class", "pkg.Class" or "module.Class"."""
    if want == have:
        return True
    h_mod, _, h_cls = have.rpartition(".")
    if "." not in want:
        return h_mod == "builtins" and h_cls == want
    w_mod, _, w_cls = want.rpartition(".")
    return w_cls == h_cls and (h_mod == w_mod or h_mod.startswith(w_mod + "."))


@dataclass(frozen=True)
class RolloutJob:
    """One rollout to run: what a backend gets (picklable)."""

    rollout_id: str
    task_id: str
    task: dict[str, Any]
    sample_index: int = 0
    attempt: int = 1
    mode: str = Mode.TRAIN.value
    policy_version: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    store_url: str | None = None
    timeout_s: float | None = None
    created_at: float = 0.0
    # A reward configuration (or its file) the rollout is scored under as it ends; picklable when
    # its functions are built-ins or import paths (the process and Ray backends pickle the job).
    rewards: RewardConfig | str | None = None


@dataclass(frozen=True)
class RolloutOutcome:
    """What a backend reports for one job (picklable).

    `ended_by_controller`: the rollout's own process could not close it (it died,
    or ran past the timeout and was stopped), so the controller ends it in the store.
    """

    status: str
    reward: float | None = None
    error: str | None = None
    error_types: tuple[str, ...] = ()
    duration_s: float = 0.0
    worker: str | None = None
    ended_by_controller: bool = False


@dataclass(frozen=True)
class RolloutResult:
    """The final result of one sample (after retries)."""

    rollout_id: str  # the last attempt's rollout
    task_id: str
    sample_index: int
    status: str
    reward: float | None
    error: str | None
    attempts: int
    policy_version: int | None
    duration_s: float
    rollout_ids: tuple[str, ...] = ()  # every attempt, oldest first
    mode: str = Mode.TRAIN.value


@dataclass
class ControllerStats:
    started: int = 0
    finished: int = 0
    retried: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    groups_started: int = 0
    groups_finished: int = 0
    groups_sat_out_uniform: int = 0  # continuous mode, `sit_out_uniform`: turns a uniform task sat out
    held_by_pause: int = 0  # times a queued rollout found the controller paused and waited (20 ms each)
    by_status: dict[str, int] = field(default_factory=dict)
