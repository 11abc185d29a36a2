"""Per-step rewards as token-level rewards: the reward of a call (turn) placed on the last
token of that call's completion in the trainer's row, 0.0 everywhere else.

After call k is merged into a row, the row is call k's prompt followed by its completion
(that is the merge condition, `rows.build_rows`), so the completion of call k spans
[len(prompt_k), len(prompt_k) + len(completion_k)) of the row. A row cut by `max_len` keeps the
reward of a call whose completion was cut on the row's last token; a call cut off entirely
loses its reward. The trainer's per-turn credit (docs/trainer.md) uses the same spans to give
each call's completion tokens that call's advantage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_middleware.records import LLMCall
from lightning_middleware.rows import Row


@dataclass(frozen=True)
class CompletionSpan:
    """Where one call's completion (the choice trained) lies in a row: tokens [start, end)."""

    call: LLMCall
    start: int
    end: int  # exclusive; clipped to the row's length (start == end: nothing of it is left)


def completion_spans(row: Row, calls: Sequence[LLMCall]) -> list[CompletionSpan]:
    """The spans of the calls in `row.call_ids`, in the row's order; `calls` are the rollout's
    calls (those of `row.call_ids` among them; a missing one is left out)."""
    by_id = {c.id: c for c in calls}
    out = []
    choices = row.choices or (0,) * len(row.call_ids)
    for call_id, choice in zip(row.call_ids, choices):
        call = by_id.get(call_id)
        if call is None:
            continue
        start = min(len(call.prompt_token_ids), len(row))
        end = min(start + len(call.choice(choice).completion_token_ids), len(row))
        out.append(CompletionSpan(call, start, end))
    return out


def token_rewards(row: Row, calls: Sequence[LLMCall], step_rewards: Mapping[int, float]) -> tuple[float, ...]:
    """Per token of `row`, the per-step reward (by call index) of the call whose completion ends
    there. `calls` are the rollout's calls (those of `row.call_ids` among them)."""
    out = [0.0] * len(row)
    for span in completion_spans(row, calls):
        if span.call.call_index in step_rewards and span.end > span.start:
            out[span.end - 1] += step_rewards[span.call.call_index]
    return tuple(out)
