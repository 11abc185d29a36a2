"""Rows to padded micro-batches: a greedy split by padded tokens, tensors shifted to the
position that predicts each token (the step-normalised loss weights come in per row)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_middleware.rows import Row


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors for some rows; per-token tensors are shifted to the predicted position."""

    index: tuple[int, ...]  # positions of these rows in the step
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T-1): input_ids[:, 1:]
    weights: torch.Tensor  # (B, T-1)
    advantages: torch.Tensor  # (B, T-1)
    behaviour_logp: torch.Tensor  # (B, T-1); 0 where unknown
    has_behaviour: torch.Tensor  # (B,) bool
    # The sampling parameters of each predicted token (B, T-1); None: T=1, no truncation anywhere.
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None


def split_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy, in order: add rows while rows x longest row stays within max_tokens (a row alone always fits)."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def make_micro_batch(rows: Sequence[Row], index: Sequence[int], weights: Sequence[torch.Tensor],
                     pad_id: int = 0) -> MicroBatch:
    T = max(len(rows[i]) for i in index)
    B = len(index)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    w = torch.zeros(B, T)
    blp = torch.zeros(B, T)
    has = torch.zeros(B, dtype=torch.bool)
    for b, i in enumerate(index):
        row, n = rows[i], len(rows[i])
        ids[b, :n] = torch.tensor(row.input_ids)
        attn[b, :n] = 1
        w[b, :n] = weights[i]
        if row.behaviour_logprobs is not None:
            blp[b, :n] = torch.tensor(row.behaviour_logprobs)
            has[b] = True
    adv = _advantages(rows, index, T)
    return MicroBatch(index=tuple(index), input_ids=ids, attention_mask=attn, targets=ids[:, 1:],
                      weights=w[:, 1:], advantages=adv, behaviour_logp=blp[:, 1:], has_behaviour=has,
                      temperature=_per_token(rows, index, T, "temperature", 1.0, torch.float32),
                      top_p=_per_token(rows, index, T, "top_p", 1.0, torch.float32),
                      top_k=_per_token(rows, index, T, "top_k", 0, torch.long))


def _advantages(rows: Sequence[Row], index: Sequence[int], T: int) -> torch.Tensor:
    """(B, T-1) advantages at the predicted positions: each row's own, or its per-turn
    `token_advantages` (padding keeps the row's `advantage`: its weight is 0 there)."""
    adv = torch.tensor([rows[i].advantage for i in index], dtype=torch.float32).unsqueeze(-1).expand(len(index), T - 1)
    if all(rows[i].token_advantages is None for i in index):
        return adv
    adv = adv.clone()
    for b, i in enumerate(index):
        per_token = rows[i].token_advantages
        if per_token is not None:
            adv[b, :len(per_token) - 1] = torch.tensor(per_token[1:], dtype=torch.float32)
    return adv


def _per_token(rows: Sequence[Row], index: Sequence[int], T: int, name: str, default: float,
               dtype: torch.dtype) -> torch.Tensor | None:
    """A row field like `temperature` as a (B, T-1) tensor at the predicted positions, or None
    when no row of the micro-batch has it (every token at the default)."""
    if all(getattr(rows[i], name) is None for i in index):
        return None
    out = torch.full((len(index), T), default, dtype=dtype)
    for b, i in enumerate(index):
        values = getattr(rows[i], name)
        if values is not None:
            out[b, :len(values)] = torch.tensor(values, dtype=dtype)
    return out[:, 1:]
