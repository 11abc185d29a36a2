"""Our rows as verl's batch: a `DataProto` for one update, and back (tests, debugging).

Mapping of a row (one whole multi-turn sequence, interleaved loss mask) to verl's split:
  prompt   = the row's tokens before its first trained token (at least one token: a token
             with no left context cannot be predicted, by either engine),
  response = everything after, observations included, `response_mask` 0 on them.
Left-padded prompts, right-padded responses, as verl's rollout produces them. The per-token
weights are the torch engine's (`grpo.loss_weights`, over the whole step) in verl's
`rollout_is_weights` channel (why: `verl_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lightning_middleware.rows import Row
from trainer_backend.algorithms.losses import loss_weights
from trainer_backend.engines.verl_loss import WEIGHTS_KEY


def split_point(row: Row) -> int:
    """Prompt length of a row in verl's split: index of its first trained token, at least 1."""
    for i, m in enumerate(row.loss_mask):
        if m:
            return max(i, 1)
    return max(len(row) - 1, 1)


def rows_to_tensors(rows: Sequence[Row], *, agg: str = "rollout-token-mean", pad_id: int = 0,
                    pad_to_multiple: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The tensors and non-tensors of `rows_to_dataproto` (see there)."""
    if not rows:
        raise ValueError("no rows")
    # weights over the whole step, from the full masks, as the torch engine does
    w_full = loss_weights([torch.tensor(r.loss_mask) for r in rows], [r.rollout_id for r in rows], agg)
    cuts = [split_point(r) for r in rows]
    n_real = len(rows)
    n = -(-n_real // pad_to_multiple) * pad_to_multiple
    P = max(cuts)
    R = max(max(len(r) - c for r, c in zip(rows, cuts)), 1)
    prompts = torch.full((n, P), pad_id, dtype=torch.long)
    responses = torch.full((n, R), pad_id, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    resp_mask = torch.zeros(n, R, dtype=torch.long)
    old = torch.zeros(n, R, dtype=torch.float32)
    adv = torch.zeros(n, R, dtype=torch.float32)
    weights = torch.zeros(n, R, dtype=torch.float32)
    has_old = np.zeros(n, dtype=bool)
    for b, (row, c) in enumerate(zip(rows, cuts)):
        ids = torch.tensor(row.input_ids, dtype=torch.long)
        k = len(row) - c
        prompts[b, P - c:] = ids[:c]
        responses[b, :k] = ids[c:]
        attn[b, P - c:P + k] = 1
        m = torch.tensor(row.loss_mask[c:], dtype=torch.long)
        resp_mask[b, :k] = m
        weights[b, :k] = w_full[b][c:]
        per_token = (torch.tensor(row.token_advantages[c:], dtype=torch.float32) if row.token_advantages is not None
                     else row.advantage)
        adv[b, :k] = per_token * m.float()
        if row.behaviour_logprobs is not None:
            old[b, :k] = torch.tensor(row.behaviour_logprobs[c:], dtype=torch.float32) * m.float()
            has_old[b] = True
    for b in range(n_real, n):  # dp padding: one prompt token, one response token, weight 0, mask 0
        attn[b, P - 1:P + 1] = 1
        has_old[b] = True
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = torch.clamp(torch.cumsum(attn, dim=1) - 1, min=0)
    tensors = dict(prompts=prompts, responses=responses, input_ids=input_ids, attention_mask=attn,
                   position_ids=position_ids, response_mask=resp_mask, old_log_probs=old, advantages=adv)
    tensors[WEIGHTS_KEY] = weights
    pad = ["__pad__"] * (n - n_real)
    non_tensors = dict(
        uid=np.array([r.task_id if r.task_id is not None else r.rollout_id for r in rows] + pad, dtype=object),
        rollout_id=np.array([r.rollout_id for r in rows] + pad, dtype=object),
        has_old_log_probs=has_old,
        is_pad=np.array([False] * n_real + [True] * (n - n_real), dtype=bool),
    )
    return tensors, non_tensors


def rows_to_dataproto(rows: Sequence[Row], *, agg: str = "rollout-token-mean", pad_id: int = 0,
                      pad_to_multiple: int = 1, temperature: float = 1.0):
    """A verl `DataProto` for one update over `rows` (advantages already set on them).

    batch (B = rows, padded up to a multiple of `pad_to_multiple` with weight-0 rows; P, R =
    longest prompt / response): prompts (B,P) left-padded, responses (B,R) right-padded,
    input_ids = [prompts|responses], attention_mask, position_ids, response_mask (1 = trained
    token), old_log_probs (vLLM's behaviour log-probs, 0 where none), advantages (the rollout's
    A on trained tokens), rollout_is_weights (our step-normalised weights `grpo.loss_weights`).
    non_tensor_batch: uid (task id = GRPO group), rollout_id, has_old_log_probs, is_pad.
    meta_info: temperature, loss aggregation, counts.
    """
    from verl import DataProto

    tensors, non_tensors = rows_to_tensors(rows, agg=agg, pad_id=pad_id, pad_to_multiple=pad_to_multiple)
    meta = dict(temperature=temperature, lightning_agg=agg, n_rows=len(rows),
                n_rollouts=len({r.rollout_id for r in rows}))
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


def dataproto_to_rows(data) -> list[Row]:
    """Inverse of `rows_to_dataproto` for the fields it carries (tests, debugging); pad rows dropped.

    Not carried: agent, policy_version, call_ids, truncated. A trained first token (no left
    context) comes back with loss-mask 0 (neither engine can train it).
    """
    b = data.batch
    P = b["prompts"].shape[1]
    out = []
    for i in range(len(data)):
        if data.non_tensor_batch["is_pad"][i]:
            continue
        attn = b["attention_mask"][i].bool()
        ids = b["input_ids"][i][attn].tolist()
        c = int(attn[:P].sum())
        k = len(ids) - c
        mask = [0] * c + b["response_mask"][i, :k].tolist()
        lps = None
        if data.non_tensor_batch["has_old_log_probs"][i]:
            lps = tuple([0.0] * c + b["old_log_probs"][i, :k].tolist())
        trained = b["response_mask"][i, :k].bool()
        on_trained = b["advantages"][i, :k][trained]
        adv = float(on_trained[0]) if bool(trained.any()) else 0.0
        per_turn = bool((on_trained != adv).any())  # per-turn credit: advantages differ by call
        token_adv = tuple([0.0] * c + b["advantages"][i, :k].tolist()) if per_turn else None
        rid = data.non_tensor_batch["rollout_id"][i]
        uid = data.non_tensor_batch["uid"][i]
        out.append(Row(rollout_id=rid, task_id=uid, agent=None, input_ids=tuple(ids), loss_mask=tuple(mask),
                       behaviour_logprobs=lps, advantage=adv, token_advantages=token_adv))
    return out
