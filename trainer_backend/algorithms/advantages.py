"""Outcome advantages for every algorithm behind `--algo`, from one reward per rollout.

    grpo          (R - mean_g) / (std_g + eps)           group-normalised (the default)
    dr_grpo       R - mean_g                             Dr. GRPO: no std (no difficulty bias)
    rloo          n/(n-1) (R - mean_g)                   leave-one-out baseline: R - mean of the others
    reinforce_pp  whiten_tokens(R - mean_g)              REINFORCE++ with a group baseline, then
                                                         whitened over all response tokens of the step
    gspo          as grpo                                (GSPO differs in its loss: a sequence-level ratio)

A "sample" is a rollout (`level="rollout"`, the default: every row of a rollout gets its
rollout's advantage) or a row (`level="sample"`, verl's view: a rollout split in k rows counts k
times in its group). Conventions follow `verl.trainer.ppo.core_algos` (tests compare to it) but
for groups of one: verl gives them R (rloo, reinforce_pp) or R/(1+eps) (grpo); here they get 0,
since one sample says nothing about its baseline.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence

import torch

from lightning_middleware.records import Rollout
from lightning_middleware.rows import Row
from trainer_backend.algorithms.grpo import group_normalize

ALGORITHMS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo")
LEVELS = ("rollout", "sample")


def group_centre(scores: torch.Tensor, groups: Sequence[Hashable], *, leave_one_out: bool = False) -> torch.Tensor:
    """R - group mean (times n/(n-1) with leave_one_out: R minus the mean of the others); groups of one: 0."""
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = torch.zeros_like(scores, dtype=torch.float32)
    for idx in members.values():
        n = len(idx)
        if n < 2:
            continue
        s = scores[idx].to(torch.float32)
        centred = s - s.mean()
        out[idx] = centred * n / (n - 1) if leave_one_out else centred
    return out


def whiten_by_tokens(values: torch.Tensor, tokens: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """verl's masked_whiten over response tokens, for a value that is constant over each sample's
    `tokens` response tokens: (v - mean) / sqrt(var + eps), mean and unbiased var over tokens."""
    weights = tokens.to(torch.float64)
    n = float(weights.sum())
    if n < 2:
        return torch.zeros_like(values)
    v = values.to(torch.float64)
    mean = (v * weights).sum() / n
    var = ((v - mean) ** 2 * weights).sum() / n * (n / (n - 1))
    return ((v - mean) * torch.rsqrt(var + eps)).to(values.dtype)


def estimate(algorithm: str, scores: torch.Tensor, groups: Sequence[Hashable], tokens: torch.Tensor,
             *, eps: float = 1e-6) -> torch.Tensor:
    """One advantage per sample (scores and token counts per sample, group ids)."""
    if algorithm in ("grpo", "gspo"):
        return group_normalize(scores, groups, norm_by_std=True, eps=eps)
    if algorithm == "dr_grpo":
        return group_normalize(scores, groups, norm_by_std=False)
    if algorithm == "rloo":
        return group_centre(scores, groups, leave_one_out=True)
    if algorithm == "reinforce_pp":
        centred = group_centre(scores, groups)
        size = Counter(groups)
        trained = torch.tensor([t > 0 and size[g] > 1 for g, t in zip(groups, tokens.tolist())])
        out = torch.zeros_like(centred)
        if trained.any():  # groups of one take no part: their advantage stays 0
            out[trained] = whiten_by_tokens(centred[trained], tokens[trained])
        return out
    raise ValueError(f"unknown algorithm {algorithm!r}; one of {ALGORITHMS}")


def advantages_for(algorithm: str, rollouts: Sequence[Rollout], rows: Sequence[Row], *,
                   level: str = "rollout") -> list[float]:
    """One advantage per row, for `rollouts` (each with its final reward) and the rows built from them."""
    if level not in LEVELS:
        raise ValueError(f"advantage level must be one of {LEVELS}, not {level!r}")
    reward: Mapping[str, float] = {r.id: float(r.final_reward or 0.0) for r in rollouts}
    if level == "sample":
        scores = torch.tensor([reward[row.rollout_id] for row in rows], dtype=torch.float32)
        tokens = torch.tensor([row.n_response_tokens for row in rows], dtype=torch.float32)
        adv = estimate(algorithm, scores, [row.task_id for row in rows], tokens)
        return [float(a) for a in adv]
    ids = [r.id for r in rollouts]
    per_rollout_tokens: dict[str, int] = defaultdict(int)
    for row in rows:
        per_rollout_tokens[row.rollout_id] += row.n_response_tokens
    scores = torch.tensor([reward[i] for i in ids], dtype=torch.float32)
    tokens = torch.tensor([per_rollout_tokens[i] for i in ids], dtype=torch.float32)
    adv = estimate(algorithm, scores, [r.task_id for r in rollouts], tokens)
    by_id = {i: float(a) for i, a in zip(ids, adv)}
    return [by_id[row.rollout_id] for row in rows]
