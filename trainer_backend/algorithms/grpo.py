"""GRPO math: group-normalised advantages, the PPO clipped loss, loss aggregation, KL, entropy.

Conventions follow `verl.trainer.ppo.core_algos` (tests compare to it), with one
deliberate difference: verl gives a group of one rollout mean 0 / std 1, i.e. the
advantage R/(1+eps); we give it 0, since one sample says nothing about the baseline.

Exactness across micro-batches: every aggregation mode is written as a weighted sum
`sum_t w_t * loss_t` whose weights are computed once over the whole step (all rows),
so the losses of any split into micro-batches add up to the full-batch loss, and so
do their gradients (docs/trainer.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from lightning_middleware.rows import Row

AGG_MODES = ("rollout-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")


# ---------------------------------------------------------------- advantages


def group_normalize(
    scores: torch.Tensor,
    groups: Sequence[Hashable],
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(score - group mean) / (group std + eps), std unbiased (n-1) as torch.std and verl.

    Groups of one get 0. A group whose scores are all equal gets 0 (std 0, eps > 0).
    """
    scores = scores.detach().to(torch.float32)
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = torch.zeros_like(scores)
    for idx in members.values():
        if len(idx) < 2:
            continue
        s = scores[idx]
        centred = s - s.mean()
        out[idx] = centred / (s.std() + eps) if norm_by_std else centred
    return out


def rollout_advantages(
    rewards: Mapping[str, float],
    task_ids: Mapping[str, str],
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> dict[str, float]:
    """Rollout-level GRPO: one advantage per rollout id, group = task id.

    Every response token of every row of the rollout gets this value.
    """
    ids = list(rewards)
    scores = torch.tensor([float(rewards[r]) for r in ids], dtype=torch.float32)
    adv = group_normalize(scores, [task_ids[r] for r in ids], norm_by_std=norm_by_std, eps=eps)
    return {r: float(a) for r, a in zip(ids, adv)}


def sample_advantages(
    rows: Sequence[Row],
    rewards: Mapping[str, float],
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """Ablation: each row is its own sample (verl's default view), rows of a rollout share its reward.

    A rollout split into k rows counts k times in its group's mean and std.
    """
    scores = torch.tensor([float(rewards[r.rollout_id]) for r in rows], dtype=torch.float32)
    adv = group_normalize(scores, [r.task_id for r in rows], norm_by_std=norm_by_std, eps=eps)
    return adv.tolist()


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


# ---------------------------------------------------------------- per-token terms


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


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) z."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] for each position; logits (B, T, V), targets (B, T)."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(z)[target] and the entropy of softmax(z), in chunks of positions.

    The same values as token_logprobs / entropy_from_logits, but the vocabulary-wide work
    happens one cache-sized chunk at a time in fp32 while the (N, V) logits stay in their own
    dtype (bf16 in the bf16 modes): no fp32 copy of the logits, no dense zero gradient for
    the gather, no saved softmax. Backward recomputes softmax per chunk:
        dlogp/dz = onehot(target) - p,    dH/dz = -p * (log p + H).
    """

    @staticmethod
    def forward(ctx, logits, targets, with_entropy: bool, chunk: int):
        z2 = logits.reshape(-1, logits.shape[-1])
        t2 = targets.reshape(-1, 1)
        n = z2.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        for i in range(0, n, chunk):
            zf = z2[i:i + chunk].float()
            lse_c = torch.logsumexp(zf, dim=-1)
            lse[i:i + chunk] = lse_c
            logp[i:i + chunk] = zf.gather(-1, t2[i:i + chunk]).squeeze(-1) - lse_c
            if ent is not None:
                lp = zf - lse_c.unsqueeze(-1)  # not in place: .float() of fp32 logits is the logits
                ent[i:i + chunk] = -(lp.exp() * lp).sum(-1)
        ctx.save_for_backward(logits, targets, lse, ent if ent is not None else lse)
        ctx.with_entropy, ctx.chunk = with_entropy, chunk
        shape = logits.shape[:-1]
        if ent is None:
            return logp.view(shape), None
        return logp.view(shape), ent.view(shape)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        z2 = logits.reshape(-1, logits.shape[-1])
        t2 = targets.reshape(-1, 1)
        n = z2.shape[0]
        g_lp = g_logp.reshape(-1, 1).float() if g_logp is not None else torch.zeros(n, 1, device=logits.device)
        g_h = g_ent.reshape(-1, 1).float() if (g_ent is not None and ctx.with_entropy) else None
        grad = torch.empty_like(logits).reshape(-1, logits.shape[-1])
        c = ctx.chunk
        for i in range(0, n, c):
            lp = z2[i:i + c].float() - lse[i:i + c].unsqueeze(-1)  # log p (a new tensor, so in-place below is safe)
            p = lp.exp()
            gz = p * -g_lp[i:i + c]
            if g_h is not None:
                gz -= p * lp.add_(ent[i:i + c].unsqueeze(-1)) * g_h[i:i + c]
            gz.scatter_add_(-1, t2[i:i + c], g_lp[i:i + c])
            grad[i:i + c] = gz
        return grad.view_as(logits), None, None, None


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True,
                           chunk: int = 32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs of the targets, entropies or None), fp32, shape logits.shape[:-1]; differentiable in both.

    Memory-light and fast form of token_logprobs + entropy_from_logits for training: see _TokenLogProbs.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    return _TokenLogProbs.apply(logits, targets, with_entropy, chunk)


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
