"""PPO's critic math: GAE over a rollout's response tokens, the clipped value loss, KL in the reward.

A rollout's response tokens, in the order of its rows (the calls' order; tool results and
prompts in between are not actions and take no part, as verl's GAE skips masked tokens),
form one trajectory. Its token rewards are 0 but at the last response token, which gets
the rollout's reward; with `kl_coef` every token's reward is also reduced by
kl_coef * KL(old || ref) at that token (verl's `use_kl_in_reward`); with per-turn credit each
call's per-step reward is added at the last token of its completion. Then, per rollout:

    delta_t = r_t + gamma V_{t+1} - V_t          (V after the last token: 0)
    A_t     = delta_t + gamma lam A_{t+1}        returns_t = A_t + V_t

and the advantages of the whole step are whitened over its response tokens (verl's
`compute_gae_advantage_return`, which the tests compare to). V_t is the critic's value at
the position that predicts token t, i.e. of the context before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CriticConfig:
    """PPO's critic: a copy of the base model with a scalar head (verl's choice), its own AdamW."""

    lr: float = 1e-5
    gamma: float = 1.0  # verl's defaults: no discount, lambda 1 (A_t = return - V_t)
    lam: float = 1.0
    cliprange_value: float = 0.5
    grad_clip: float | None = 1.0
    # Steps during which only the critic learns (verl's critic_warmup): a random value head gives
    # the first policy updates noise for advantages.
    warmup_steps: int = 0


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of one trajectory of n action tokens (1-D tensors, no masking)."""
    n = rewards.shape[0]
    adv = torch.zeros(n, dtype=torch.float32)
    next_value, last = torch.tensor(0.0), torch.tensor(0.0)
    r, v = rewards.float(), values.float()
    for t in reversed(range(n)):
        delta = r[t] + gamma * next_value - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_value = v[t]
    return adv, adv + v


def whiten(values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """verl's masked_whiten over the given (already selected) values: unbiased variance."""
    if values.numel() < 2:
        return torch.zeros_like(values)
    mean = values.mean()
    var = values.var(unbiased=True)
    return (values - mean) * torch.rsqrt(var + eps)


def rollout_advantages_and_returns(
    rollout_of: Sequence[str],
    reward_of: dict[str, float],
    values: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor] | None = None,
    *,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    step_rewards: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row, the advantages (whitened over the step) and returns at its response tokens.

    `values[i]` (and `kl[i]`, `step_rewards[i]`) hold row i's critic values (KL estimates,
    per-step token rewards of per-turn credit) at its response tokens, in order; rows of one
    rollout are concatenated in the order given.
    """
    members: dict[str, list[int]] = {}
    for i, rid in enumerate(rollout_of):
        members.setdefault(rid, []).append(i)
    adv: list[torch.Tensor] = [torch.zeros(0)] * len(values)
    ret: list[torch.Tensor] = [torch.zeros(0)] * len(values)
    for rid, idx in members.items():
        v = torch.cat([values[i].float() for i in idx])
        r = torch.zeros_like(v)
        if v.numel():
            r[-1] = reward_of[rid]
        if kl is not None and kl_coef:
            r = r - kl_coef * torch.cat([kl[i].float() for i in idx])
        if step_rewards is not None:
            r = r + torch.cat([step_rewards[i].float() for i in idx])
        a, g = gae(r, v, gamma, lam)
        sizes = [values[i].numel() for i in idx]
        for i, a_i, g_i in zip(idx, a.split(sizes), g.split(sizes)):
            adv[i], ret[i] = a_i, g_i
    flat = whiten(torch.cat(adv)) if adv else torch.zeros(0)
    return list(flat.split([a.numel() for a in adv])), ret


def value_loss(vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weights: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's compute_value_loss with the step's aggregation weights (so micro-batches add up):
    0.5 sum_t w_t max((V - R)^2, (clip(V, V_old -/+ c) - R)^2)."""
    clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    loss1 = (vpreds - returns).square()
    loss2 = (clipped - returns).square()
    mask = (weights != 0).float()
    loss = 0.5 * (torch.maximum(loss1, loss2) * weights).sum()
    return loss, {
        "vf_loss": loss.detach(),
        "vf_clipped_tokens": ((loss2 > loss1).float() * mask).sum(),
        "vpred_sum": (vpreds.detach() * mask).sum(),
        "vf_err_sum": ((vpreds.detach() - returns) * mask).sum(),
        "vf_sq_err_sum": ((vpreds.detach() - returns).square() * mask).sum(),
        "return_sum": (returns * mask).sum(),
        "return_sq_sum": (returns.square() * mask).sum(),
        "tokens": mask.sum(),
    }
