"""Per-step rewards as token-level rewards: the reward of a call (turn) placed on the last
token of that call's completion in the trainer's row, 0.0 everywhere else.

After call k is merged into a row, the row is call k's prompt followed by its completion
(that is the merge condition, `rows.build_rows`), so the completion of call k ends at
len(prompt_k) + len(completion_k) - 1. A row cut by `max_len` keeps the reward of a call whose
completion was cut on the row's last token; a call cut off entirely loses its reward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_middleware.records import LLMCall
from lightning_middleware.rows import Row


def token_rewards(row: Row, calls: Sequence[LLMCall], step_rewards: Mapping[int, float]) -> tuple[float, ...]:
    """Per token of `row`, the per-step reward (by call index) of the call whose completion ends
    there. `calls` are the rollout's calls (those of `row.call_ids` among them)."""
    by_id = {c.id: c for c in calls}
    out = [0.0] * len(row)
    choices = row.choices or (0,) * len(row.call_ids)
    for call_id, choice in zip(row.call_ids, choices):
        call = by_id.get(call_id)
        if call is None or call.call_index not in step_rewards:
            continue
        start = len(call.prompt_token_ids)
        end = start + len(call.choice(choice).completion_token_ids) - 1
        if start >= len(row) or end < start:
            continue  # cut off entirely by truncation, or an empty completion
        out[min(end, len(row) - 1)] += step_rewards[call.call_index]
    return tuple(out)
