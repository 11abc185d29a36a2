"""DPO (Rafailov et al. 2023; TRL's `loss_type="sigmoid"`, which the tests compare to), online
from the store's task groups or offline from exported preference pairs.

    loss = mean over pairs of -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))

with pi and ref the summed log-probs of a rollout's response tokens (every row of it) under
the policy and the frozen reference. With `label_smoothing` e (conservative DPO, the form of
TRL's sigmoid loss before 1.0): loss = -(1-e) log s(beta d) - e log s(-beta d).

Pairs online: per task group, the best- against the worst-rewarded rollout (the earlier one on
ties within the best or worst reward); a group whose best and worst rewards are equal gives no
pair. The rollouts in between do not train. A pair is keyed by its task id, the rows carry
+1 (chosen) or -1 (rejected) as their advantage: that is all the engine needs.

Exact across micro-batches: the loss is not a sum over tokens, so the engine first takes
every rollout's summed log-probs without gradients, computes the loss and its derivative
c_r = dL/dpi_r per rollout, then back-propagates sum_r c_r * sum_t logp_t micro-batch by
micro-batch, whose gradient is the full loss's (one extra no-grad forward per step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_middleware.records import Rollout


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1
    label_smoothing: float = 0.0  # cDPO: the probability that a pair's label is flipped


@dataclass(frozen=True)
class Pair:
    key: str  # the task id (online) or the record id (offline)
    chosen: str  # rollout ids
    rejected: str


def pairs_from_groups(rollouts: Sequence[Rollout]) -> list[Pair]:
    """Best vs worst per task group; ties between best and worst give no pair."""
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        if r.final_reward is not None:
            groups.setdefault(r.task_id, []).append(r)
    pairs = []
    for task, members in groups.items():
        ordered = sorted(members, key=lambda r: (-float(r.final_reward or 0.0), r.created_at))
        best = ordered[0]
        worst = min(ordered, key=lambda r: float(r.final_reward or 0.0))  # min keeps the earliest of the worst
        if float(best.final_reward or 0.0) > float(worst.final_reward or 0.0):
            pairs.append(Pair(task, best.id, worst.id))
    return pairs


def preference_advantages(pairs: Sequence[Pair]) -> dict[str, float]:
    """+1 for each chosen rollout, -1 for each rejected one (the rows' labels for the engine)."""
    out: dict[str, float] = {}
    for p in pairs:
        out[p.chosen], out[p.rejected] = 1.0, -1.0
    return out


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


def pairs_from_rows(keys: Sequence[str | None], rollout_ids: Sequence[str], labels: Sequence[float]) -> list[Pair]:
    """Pairs back from rows labelled +1/-1 and keyed by task id; a key without both sides is an error."""
    sides: dict[str, dict[float, str]] = {}
    for key, rid, label in zip(keys, rollout_ids, labels):
        if label not in (1.0, -1.0):
            raise ValueError(f"DPO rows carry +1 (chosen) or -1 (rejected) as their advantage, not {label}")
        if key is None:
            raise ValueError(f"DPO row of rollout {rid} has no task id to pair it by")
        seen = sides.setdefault(key, {}).setdefault(label, rid)
        if seen != rid:
            raise ValueError(f"pair {key!r} has two {'chosen' if label > 0 else 'rejected'} rollouts: {seen}, {rid}")
    missing = [k for k, s in sides.items() if len(s) != 2]
    if missing:
        raise ValueError(f"pair {missing[0]!r} lacks its {'rejected' if 1.0 in sides[missing[0]] else 'chosen'} side")
    return [Pair(k, s[1.0], s[-1.0]) for k, s in sides.items()]
