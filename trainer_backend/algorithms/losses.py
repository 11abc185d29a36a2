"""Which loss each token contributes: the PPO clipped surrogate with its clips, GSPO's sequence
ratio, the KL to the reference, the entropy bonus, the aggregation weights, PPO's value loss, and
DPO's loss.

Conventions follow `verl.trainer.ppo.core_algos` (tests compare to it). Exactness across
micro-batches: every aggregation mode is written as a weighted sum `sum_t w_t * loss_t` whose
weights are computed once over the whole step (all rows), so the losses of any split into
micro-batches add up to the full-batch loss, and so do their gradients (docs/trainer.md).

DPO (Rafailov et al. 2023; TRL's `loss_type="sigmoid"`, which the tests compare to):

    loss = mean over pairs of -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))

with pi and ref the summed log-probs of a rollout's response tokens under the policy and the
frozen reference; with `label_smoothing` e: -(1-e) log s(beta d) - e log s(-beta d). The loss is
not a sum over tokens, so the engine first takes every rollout's summed log-probs without
gradients, computes c_r = dL/dpi_r per rollout (`rollout_coefficients`), then back-propagates
sum_r c_r * sum_t logp_t micro-batch by micro-batch, whose gradient is the full loss's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from trainer_backend.algorithms.advantages import Pair

AGG_MODES = ("rollout-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


KL_KINDS = ("k1", "k2", "k3")


RATIO_LEVELS = ("token", "sequence")


# ---------------------------------------------------------------- aggregation weights


def loss_weights(
    masks: Sequence[torch.Tensor],
    rollout_ids: Sequence[str],
    mode: str = "rollout-token-mean",
) -> list[torch.Tensor]:
    """Per-token weights (same shape as each mask), normalised over the whole step.

    rollout-token-mean: 1 / (n_rollouts * n_response_tokens of the token's rollout)
    token-mean:         1 / n_response_tokens in the step
    seq-mean-token-mean:1 / (n_rows * n_response_tokens of the token's row)
    seq-mean-token-sum: 1 / n_rows
    Masked tokens get 0; rows and rollouts without response tokens are not counted.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; one of {AGG_MODES}")
    masks = [m.to(torch.float32) for m in masks]
    row_tokens = [float(m.sum()) for m in masks]
    if mode == "token-mean":
        total = sum(row_tokens)
        return [m / total if total else m * 0 for m in masks]
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        n_rows = sum(1 for n in row_tokens if n > 0)
        if mode == "seq-mean-token-sum":
            return [m / n_rows if n_rows else m * 0 for m in masks]
        return [m / (n_rows * n) if n > 0 else m * 0 for m, n in zip(masks, row_tokens)]
    per_rollout: dict[str, float] = defaultdict(float)
    for rid, n in zip(rollout_ids, row_tokens):
        per_rollout[rid] += n
    n_rollouts = sum(1 for n in per_rollout.values() if n > 0)
    return [m / (n_rollouts * per_rollout[rid]) if per_rollout[rid] > 0 else m * 0
            for m, rid in zip(masks, rollout_ids)]


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "rollout-token-mean",
    rollout_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """Full-batch aggregation of a (rows, T) loss matrix; rollout_ids needed for rollout-token-mean."""
    if rollout_ids is None:
        if mode == "rollout-token-mean":
            raise ValueError("rollout-token-mean needs rollout_ids")
        rollout_ids = [str(i) for i in range(mask.shape[0])]
    weights = torch.stack(loss_weights(list(mask), rollout_ids, mode))
    return (loss_mat * weights).sum()


# ---------------------------------------------------------------- the token loss


@dataclass(frozen=True)
class TokenLoss:
    """Per-token PPO terms, all shaped like the log-probs."""

    pg_loss: torch.Tensor  # the clipped surrogate, to be weighted and summed
    clipped: torch.Tensor  # bool: the (1 -/+ eps) clip was active
    clipped_lower: torch.Tensor  # bool: the dual clip was active (advantage < 0)
    neg_log_ratio: torch.Tensor  # old - new: its mean is verl's ppo_kl


def ppo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    log_ratio: torch.Tensor | None = None,
) -> TokenLoss:
    """PPO clipped surrogate as verl's `compute_policy_loss_vanilla`, per token.

    loss = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)), r = exp(clamp(logp - old, -20, 20));
    with dual clip (c > 1): for A < 0, loss = min(loss, -A c).
    """
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0) if log_ratio is None else log_ratio
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    clipped_lower = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError("dual_clip_c must be > 1")
        loss3 = -adv * dual_clip_c
        clipped_lower = (pg > loss3) & (adv < 0)
        pg = torch.where(adv < 0, torch.minimum(pg, loss3), pg)
    return TokenLoss(pg_loss=pg, clipped=clipped, clipped_lower=clipped_lower, neg_log_ratio=-log_ratio)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ratio (verl's compute_policy_loss_gspo), per token: log s_i,t = sg[log s_i] + logp - sg[logp],
    log s_i = the mean log-ratio over row i's response tokens; clamped at 10 as verl does."""
    n = mask.sum(-1).clamp(min=1)
    seq = ((logp - old_logp) * mask).sum(-1) / n
    return torch.clamp(logp - logp.detach() + seq.detach().unsqueeze(-1), max=10.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || ref) estimate, as verl's kl_penalty: k1 = logp - ref;
    k2 = (logp - ref)^2 / 2; k3 = e^d - d - 1, d = ref - logp (Schulman's estimators)."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        d = torch.clamp(ref_logp - logp, min=-20, max=20)
        return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
    raise ValueError(f"unknown KL estimator {kind!r}; one of {KL_KINDS}")


# ---------------------------------------------------------------- the step loss


@dataclass(frozen=True)
class LossConfig:
    agg: str = "rollout-token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual clip (verl's clip_ratio_c, which verl applies by default): for A < 0 the token loss is at
    # most -A*c. Without it a stale token whose probability rose c-fold or more since it was
    # sampled pushes with weight ratio*|A|: in the async demo one ratio-20 token made a step's
    # gradient norm 100x the usual. None turns it off.
    dual_clip_c: float | None = 3.0
    kl_coef: float = 0.0  # > 0 adds kl_coef * KL(policy || ref) to the loss (needs ref log-probs)
    kl_kind: str = "k3"
    entropy_coef: float = 0.0  # > 0 subtracts entropy_coef * entropy (an exploration bonus)
    # "token": PPO's per-token ratio; "sequence": GSPO's ratio, the geometric mean over a row's
    # response tokens (its gradient still flows per token), without the dual clip, as verl's gspo.
    ratio_level: str = "token"
    # Truncated importance sampling for stale rollouts (verl's token-level rollout correction, as the
    # reference system's threshold 2): the ratio is taken against the current policy before the
    # update and each token's loss is weighted by min(pi_current / pi_behaviour, tis_threshold).
    # None: off (the ratio is against vLLM's behaviour log-probs, clipped and dual-clipped).
    tis_threshold: float | None = None
    # KL to the reference in the reward instead of the loss (verl's use_kl_in_reward): each response
    # token's reward loses kl_in_reward_coef * KL(old || ref) (engines/model_advantages.py). With an
    # outcome algorithm the engine then estimates advantages again, by `advantage` (advantages.py).
    kl_in_reward_coef: float = 0.0
    advantage: str = "grpo"


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig = LossConfig(),
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    behaviour_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch: sum_t w_t (pg_t + kl_coef kl_t - entropy_coef H_t).

    With `cfg.tis_threshold`, `old_logp` should be the current policy's log-probs before the
    update and `behaviour_logp` vLLM's: pg_t is weighted by min(exp(old - behaviour), threshold).

    `weights` come from `loss_weights` over the whole step and are 0 off the response,
    so micro-batch losses add up to the step loss. Also returns detached sums from which
    the step's metrics are formed (weighted sums and plain response-token counts).
    """
    mask = (weights != 0).float()
    if cfg.ratio_level == "sequence":
        terms = ppo_token_loss(logp, old_logp, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                               log_ratio=sequence_log_ratio(logp, old_logp, mask))
        # the KL and ratio metrics stay per token (verl's ppo_kl for GSPO too)
        terms = replace(terms, neg_log_ratio=torch.clamp(old_logp - logp, min=-20.0, max=20.0))
    elif cfg.ratio_level == "token":
        terms = ppo_token_loss(logp, old_logp, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                               dual_clip_c=cfg.dual_clip_c)
    else:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, not {cfg.ratio_level!r}")
    pg_tokens = terms.pg_loss
    tis_sums: dict[str, torch.Tensor] = {}
    if cfg.tis_threshold is not None:
        if behaviour_logp is None:
            raise ValueError("tis_threshold needs behaviour_logp")
        raw = torch.exp(torch.clamp(old_logp - behaviour_logp, min=-20.0, max=20.0)).detach()
        tis = torch.clamp(raw, max=cfg.tis_threshold)
        pg_tokens = pg_tokens * tis
        tis_sums = {"tis_weight_sum": (tis * mask).sum(),
                    "tis_truncated_tokens": ((raw > cfg.tis_threshold) * mask).sum()}
    pg = (pg_tokens * weights).sum()
    loss = pg
    sums = {
        "pg_loss": pg.detach(),
        "clipped_tokens": (terms.clipped.float() * mask).sum(),
        "clipped_lower_tokens": (terms.clipped_lower.float() * mask).sum(),
        "neg_log_ratio_sum": (terms.neg_log_ratio.detach() * mask).sum(),
        "response_tokens": mask.sum(),
        # The largest new/old probability ratio on a response token (as its log): stale rollouts with a
        # negative advantage and a large ratio are what the dual clip bounds. Aggregated by max.
        # (numel, not mask.any(): no device sync per micro-batch; an all-masked batch gives -inf)
        "log_ratio_max": (-terms.neg_log_ratio.detach()).masked_fill(mask == 0, float("-inf")).max()
        if mask.numel() else torch.tensor(float("-inf")),
    }
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, cfg.kl_kind)
        kl_w = (kl * weights).sum()
        sums["kl_ref"] = kl_w.detach()
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * kl_w
    elif cfg.kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if entropy is not None:
        ent_w = (entropy * weights).sum()
        sums["entropy"] = ent_w.detach()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent_w
    elif cfg.entropy_coef:
        raise ValueError("entropy_coef > 0 needs entropy")
    sums.update(tis_sums)
    sums["loss"] = loss.detach()
    return loss, sums


# ---------------------------------------------------------------- PPO's value loss


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


# ---------------------------------------------------------------- DPO


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1
    label_smoothing: float = 0.0  # cDPO: the probability that a pair's label is flipped


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             cfg: DPOConfig = DPOConfig()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(mean loss over pairs, TRL's metrics): all inputs are summed log-probs, one per pair."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    logits = cfg.beta * (chosen_ratio - rejected_ratio)
    e = cfg.label_smoothing
    losses = -(1 - e) * F.logsigmoid(logits) - e * F.logsigmoid(-logits)
    chosen_rewards, rejected_rewards = cfg.beta * chosen_ratio.detach(), cfg.beta * rejected_ratio.detach()
    return losses.mean(), {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen.detach().mean(),
        "logps/rejected": rejected.detach().mean(),
    }


def rollout_coefficients(pairs: Sequence[Pair], logp: Mapping[str, float], ref_logp: Mapping[str, float],
                         cfg: DPOConfig) -> tuple[dict[str, float], dict[str, float]]:
    """(dL/dpi_r per rollout, the step's metrics incl. the loss), from summed log-probs by rollout id."""
    def stack(ids: list[str], source: Mapping[str, float], grad: bool) -> torch.Tensor:
        return torch.tensor([source[i] for i in ids], dtype=torch.float64, requires_grad=grad)

    chosen_ids, rejected_ids = [p.chosen for p in pairs], [p.rejected for p in pairs]
    pc, pr = stack(chosen_ids, logp, True), stack(rejected_ids, logp, True)
    loss, metrics = dpo_loss(pc, pr, stack(chosen_ids, ref_logp, False), stack(rejected_ids, ref_logp, False), cfg)
    gc, gr = torch.autograd.grad(loss, (pc, pr))
    coef = {**dict(zip(chosen_ids, gc.tolist())), **dict(zip(rejected_ids, gr.tolist()))}
    return coef, {"dpo_loss": float(loss), **{k.replace("/", "_"): float(v) for k, v in metrics.items()}}
