"""Our policy loss inside verl: `grpo.policy_loss` registered in verl's policy-loss registry.

Weighting (why verl's own `loss_agg_mode` is not used): verl aggregates per micro-batch with
`agg_loss`, normalising `token-mean` by the global mini-batch token count and `seq-mean-*`
by the global number of sequences; none of them is the rollout-level token mean (a rollout
is several sequences). Its policy-loss hook receives exactly one extra per-token tensor,
`rollout_is_weights` (multiplied into the per-token loss by verl's own losses). We put our
weights `w_t` (computed once over the whole step, before any split: `verl_rows`) there and
register the policy loss `lightning_rollout` that returns `policy_loss(...) * dp_size` =
`dp_size * sum_t w_t l_t` over the micro-batch. The FSDP engine calls `backward()` on each
micro-batch loss unscaled and FSDP averages gradients over the dp ranks, so the update's
gradient is `sum over all tokens of the step of w_t grad l_t`: exact under any mini/micro/dp
split, as long as one update = one mini-batch (`ppo_mini_batch_size` = the whole step, 1
epoch). `loss_agg_mode` is set to `token-sum`; verl's separate entropy/KL terms would be
aggregated unweighted, so the verl engine requires `kl_coef == entropy_coef == 0` (the defaults).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_backend.algorithms.losses import LossConfig, policy_loss

LOSS_MODE = "lightning_rollout"  # registered verl policy loss; `_dual` variant applies clip_ratio_c
LOSS_MODE_DUAL = "lightning_rollout_dual"
WEIGHTS_KEY = "rollout_is_weights"  # verl's per-token multiplier channel into the policy loss


def _lightning_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, loss_agg_mode: str = "token-sum", config: Any = None,
                           rollout_is_weights: torch.Tensor | None = None, *, dual: bool = False):
    """verl policy-loss signature over our `grpo.policy_loss`: dp_size * sum_t w_t l_t (w in rollout_is_weights)."""
    if rollout_is_weights is None:
        raise ValueError(f"policy loss {LOSS_MODE!r} needs the step-normalised weights in {WEIGHTS_KEY!r} "
                         "(see verl_rows.rows_to_dataproto)")
    cfg = LossConfig(clip_low=config.clip_ratio_low, clip_high=config.clip_ratio_high,
                     dual_clip_c=config.clip_ratio_c if dual else None)
    weights = rollout_is_weights * response_mask.to(rollout_is_weights.dtype)
    loss, sums = policy_loss(log_prob.float(), old_log_prob.float(), advantages.float(), weights.float(), cfg)
    dp_size = (getattr(config, "global_batch_info", None) or {}).get("dp_size", 1) or 1
    n = torch.clamp(sums["response_tokens"], min=1.0)
    metrics = {  # verl averages these over micro-batches (like its own vanilla loss)
        "actor/pg_clipfrac": float(sums["clipped_tokens"] / n),
        "actor/ppo_kl": float(sums["neg_log_ratio_sum"] / n),
        "actor/pg_clipfrac_lower": float(sums["clipped_lower_tokens"] / n),
    }
    return loss * dp_size, metrics


def register_policy_loss() -> None:
    """Register `lightning_rollout` (+ `_dual`) in verl's policy-loss registry (idempotent; runs on import)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    def plain(*args, **kwargs):
        return _lightning_policy_loss(*args, **kwargs, dual=False)

    def dual(*args, **kwargs):
        return _lightning_policy_loss(*args, **kwargs, dual=True)

    POLICY_LOSS_REGISTRY.setdefault(LOSS_MODE, plain)
    POLICY_LOSS_REGISTRY.setdefault(LOSS_MODE_DUAL, dual)


try:  # every Ray worker must register it too: unpickling the worker class imports verl_engine, which imports this
    register_policy_loss()
except ImportError:  # verl absent: the row conversion still imports
    pass
