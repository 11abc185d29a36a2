"""Advantages that need the model, computed by the engine before its update (one no-grad pass):

- PPO: the critic's values at every response token, GAE per rollout (algorithms/advantages.py),
  whitened over the step; the returns are kept for the critic's update. With per-turn credit
  the rows' per-step token rewards join the rollout's reward inside GAE.
- A KL penalty in the reward (`LossConfig.kl_in_reward_coef`, verl's `use_kl_in_reward`):
  each response token's reward loses coef * KL(old || ref). With PPO that is a token reward;
  for the outcome algorithms the rollout's score becomes R - coef * sum_t KL_t (as verl sums
  token rewards into the score) and its advantage is estimated again from the new scores.

Everything else (GRPO and its family without a KL reward) keeps the daemon's advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from lightning_middleware.rows import Row
from trainer_backend.algorithms.advantages import CriticConfig, estimate, rollout_advantages_and_returns
from trainer_backend.algorithms.losses import LossConfig, kl_estimate
from trainer_backend.engines.batching import MicroBatch

Forward = Callable[[MicroBatch], torch.Tensor]  # a micro-batch -> (B, T-1) per predicted position


@dataclass(frozen=True)
class ModelAdvantages:
    batches: list[MicroBatch]  # with per-token advantages
    old_values: list[torch.Tensor] | None  # PPO: the critic's values before its update, (B, T-1)
    returns: list[torch.Tensor] | None  # PPO: the value targets, (B, T-1)
    metrics: dict[str, float]


def _response_positions(row: Row) -> torch.Tensor:
    """Positions (in the shifted, predicted-token frame) of the row's response tokens."""
    return torch.tensor(row.loss_mask[1:], dtype=torch.bool).nonzero().squeeze(-1)


def _per_row(rows: Sequence[Row], batches: Sequence[MicroBatch], per_batch: Sequence[torch.Tensor]
             ) -> list[torch.Tensor]:
    """Row i's values at its response tokens, from (B, T-1) tensors per micro-batch."""
    out: list[torch.Tensor] = [torch.zeros(0)] * len(rows)
    for mb, values in zip(batches, per_batch):
        for b, i in enumerate(mb.index):
            out[i] = values[b].detach().float().cpu()[_response_positions(rows[i])]
    return out


def _scatter(rows: Sequence[Row], batches: Sequence[MicroBatch], per_row: Sequence[torch.Tensor]
             ) -> list[torch.Tensor]:
    """The inverse of _per_row: (B, T-1) tensors, 0 off the response."""
    out = []
    for mb in batches:
        t = torch.zeros(mb.targets.shape, dtype=torch.float32)
        for b, i in enumerate(mb.index):
            t[b, _response_positions(rows[i])] = per_row[i]
        out.append(t)
    return out


def _step_rewards(rows: Sequence[Row]) -> list[torch.Tensor] | None:
    """Per row, its per-step token rewards (per-turn credit) at its response tokens; None without any."""
    if all(r.token_rewards is None for r in rows):
        return None
    return [torch.tensor((r.token_rewards or (0.0,) * len(r))[1:], dtype=torch.float32)[_response_positions(r)]
            for r in rows]


def needs_model(loss: LossConfig, critic: CriticConfig | None) -> bool:
    return critic is not None or loss.kl_in_reward_coef > 0


def compute(rows: Sequence[Row], batches: Sequence[MicroBatch], old: Sequence[torch.Tensor], loss: LossConfig, *,
            critic: CriticConfig | None, values: Forward | None, ref_logprobs: Forward | None) -> ModelAdvantages:
    """Per-token advantages for `batches` (and PPO's returns); `old` = the old log-probs per micro-batch."""
    missing = [r.rollout_id for r in rows if r.reward is None]
    if missing:
        raise ValueError(f"rows of rollout {missing[0]} carry no reward: set it with with_advantages(rewards=...)")
    reward_of = {r.rollout_id: float(r.reward or 0.0) for r in rows}
    kl_rows = None
    metrics: dict[str, float] = {}
    if loss.kl_in_reward_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_in_reward_coef > 0 needs the reference model")
        kl = [kl_estimate(o.float(), ref_logprobs(mb).float(), loss.kl_kind) for mb, o in zip(batches, old)]
        kl_rows = _per_row(rows, batches, kl)
        n = sum(k.numel() for k in kl_rows)
        metrics["kl_in_reward"] = float(sum(k.sum() for k in kl_rows)) / max(n, 1)
    if critic is not None:
        if values is None:
            raise ValueError("PPO needs the critic's values")
        old_values = [values(mb) for mb in batches]
        adv_rows, ret_rows = rollout_advantages_and_returns(
            [r.rollout_id for r in rows], reward_of, _per_row(rows, batches, old_values), kl_rows,
            kl_coef=loss.kl_in_reward_coef, gamma=critic.gamma, lam=critic.lam, step_rewards=_step_rewards(rows))
        adv = _scatter(rows, batches, adv_rows)
        returns = _scatter(rows, batches, ret_rows)
        return ModelAdvantages([replace(mb, advantages=a) for mb, a in zip(batches, adv)],
                               [v.detach().cpu() for v in old_values], returns, metrics)
    assert kl_rows is not None
    if any(r.token_advantages is not None for r in rows):
        raise ValueError("per-turn credit with the KL in the reward runs with ppo only: put the KL in the loss")
    return ModelAdvantages(_outcome(rows, batches, reward_of, kl_rows, loss), None, None, metrics)


def _outcome(rows: Sequence[Row], batches: Sequence[MicroBatch], reward_of: dict[str, float],
             kl_rows: Sequence[torch.Tensor], loss: LossConfig) -> list[MicroBatch]:
    """Outcome algorithms with a KL reward: rollout scores R - coef * sum KL, advantages again."""
    ids = list(dict.fromkeys(r.rollout_id for r in rows))
    kl_sum = dict.fromkeys(ids, 0.0)
    tokens = dict.fromkeys(ids, 0)
    task: dict[str, str | None] = {}
    for r, k in zip(rows, kl_rows):
        kl_sum[r.rollout_id] += float(k.sum())
        tokens[r.rollout_id] += r.n_response_tokens
        task[r.rollout_id] = r.task_id
    scores = torch.tensor([reward_of[i] - loss.kl_in_reward_coef * kl_sum[i] for i in ids])
    adv = estimate(loss.advantage, scores, [task[i] for i in ids], torch.tensor([float(tokens[i]) for i in ids]))
    by_id = dict(zip(ids, adv.tolist()))
    return [replace(mb, advantages=torch.tensor([by_id[rows[i].rollout_id] for i in mb.index]
                                                ).unsqueeze(-1).expand_as(mb.advantages).clone())
            for mb in batches]
