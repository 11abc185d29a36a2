"""Reward functions for the guess-the-number demo's reward configurations (examples/rewards/).

- `tool_call_bonus`: a rule that counts the rollout's tool calls. With a positive weight it is
  the deliberately hackable reward of `hackable.toml`: a policy earns more by guessing longer,
  so it learns to avoid the secret on its early guesses.
- `extra_guesses`: a guard, the guesses beyond what exact bisection needs for this secret (the
  task's own step budget). Penalising each at the bonus's weight cancels the bonus for every
  call the task does not need, whatever the policy does with them.
- `wasted_guesses`: a guard, the guesses the earlier answers had already ruled out (a repeat, or
  a number outside the range still possible): calls that cannot help find the secret.

Both guards read the secret from the rollout's stored input (the controller stores the task);
they are absent (None) on a rollout without one.
"""

from __future__ import annotations

from typing import Any

from lightning_middleware.rewards import Score, Trajectory
from trainer_backend.demo.task import HIGH, LOW, answer, bisection_guesses


def _secret(t: Trajectory) -> int | None:
    task: Any = t.rollout.input
    secret = task.get("secret") if isinstance(task, dict) else None
    return secret if isinstance(secret, int) else None


def _guesses(t: Trajectory) -> list[Any]:
    return [(tc.parsed or {}).get("n") for tc in t.tool_calls]


def tool_call_bonus(t: Trajectory) -> float:
    """The number of tool calls (weight: the bonus per call)."""
    return float(len(t.tool_calls))


def extra_guesses(t: Trajectory) -> Score | None:
    """Guesses beyond the number exact bisection needs for the rollout's secret."""
    secret = _secret(t)
    if secret is None:
        return None
    needed = len(bisection_guesses(secret))
    made = len(t.tool_calls)
    return Score(float(max(0, made - needed)), {"guesses": made, "needed": needed})


def wasted_guesses(t: Trajectory) -> Score | None:
    """Guesses outside the range the earlier answers left (repeats included), or not a number."""
    secret = _secret(t)
    if secret is None:
        return None
    lo, hi, wasted = LOW, HIGH, []
    for i, g in enumerate(_guesses(t)):
        said = answer(secret, g)
        if said == "invalid" or not lo <= int(g) <= hi:
            wasted.append(i)
        if said == "higher":
            lo = max(lo, int(g) + 1)
        elif said == "lower":
            hi = min(hi, int(g) - 1)
    return Score(float(len(wasted)), {"wasted": wasted})
