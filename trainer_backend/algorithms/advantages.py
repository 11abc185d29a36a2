"""Which advantage each token gets: every estimator behind `--algo` and `credit`, in one place.

Outcome advantages, one per rollout from its final reward R (group = task):

    grpo, gspo    (R - mean_g) / (std_g + eps)           group-normalised (the default); GSPO
                                                         differs in its loss (losses.py)
    dr_grpo       R - mean_g                             Dr. GRPO: no std (no difficulty bias)
    rloo          n/(n-1) (R - mean_g)                   leave-one-out: R - mean of the others
    reinforce_pp  whiten_by_tokens(R - mean_g)           REINFORCE++ with a group baseline, whitened
                                                         over all response tokens of the step
    ppo           GAE from a critic's values             (`gae`, `rollout_advantages_and_returns`)
    dpo           +1 / -1                                the best against the worst rollout of a group

A "sample" is a rollout (`level="rollout"`, the default: every row of a rollout gets its
rollout's advantage) or a row (`level="sample"`, verl's view: a rollout split in k rows counts k
times in its group). Conventions follow `verl.trainer.ppo.core_algos` (tests compare to it) but
for groups of one: verl gives them R (rloo, reinforce_pp) or R/(1+eps) (grpo); here they get 0,
since one sample says nothing about its baseline.

Per-turn credit (`credit = "per-turn"`): every call k of rollout r gets its own advantage, from
its return

    G_rk = s_rk + gamma G_r,k+1,     G_rK = s_rK + R_r       (K_r trained calls, in call order)

i.e. the per-step rewards s (`emit_reward(v, call_index=...)`) of that call and the later ones,
discounted by turns (`credit_gamma`, default 1), and the final reward as the last turn's. Group
statistics weigh each rollout once (a turn 1/K_r):

    mean_g = (1/n) sum_r (1/K_r) sum_k G_rk
    var_g  = 1/(n-1) sum_r (1/K_r) sum_k (G_rk - mean_g)^2

so without per-step rewards (and gamma 1) every G_rk = R_r and the advantages are the
rollout-level ones. Then as the algorithm does with rewards (rloo: G minus the mean of the other
rollouts' mean returns); with ppo each per-step reward is a token reward at the last token of its
call's completion, inside GAE. Groups of one and groups whose returns are all equal get 0 (before
reinforce_pp's whitening, which takes the latter in). A rollout without a trained call stands in
its group's statistics with R_r, weight 1. A call's advantage goes to the tokens of its completion
in its row (`rewards.steps.completion_spans`).

Per policy (separate policies per agent): each policy is labelled on its own rows, so its groups
are (task, policy); an agent with its own rewards (`emit_reward(v, agent=...)`) is its own group
within its policy (`label`).

PPO: a rollout's response tokens, in the order of its rows, form one trajectory; its token rewards
are 0 but at the last response token, which gets the rollout's reward (minus kl_coef * KL(old ||
ref) per token with the KL in the reward, plus per-step rewards with per-turn credit). Then

    delta_t = r_t + gamma V_{t+1} - V_t          (V after the last token: 0)
    A_t     = delta_t + gamma lam A_{t+1}        returns_t = A_t + V_t

and the step's advantages are whitened over its response tokens (verl's
`compute_gae_advantage_return`). V_t is the critic's value of the context before token t.

DPO pairs: per task group, the best- against the worst-rewarded rollout (the earlier one on ties);
a group whose best and worst rewards are equal gives no pair. The rows carry +1 (chosen) or -1
(rejected) as their advantage, keyed by task id: all the engine needs (losses.py).

docs/trainer.md, "Advantages" and "Per-turn credit".
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_middleware import TraceStore
from lightning_middleware.records import LLMCall, Rollout
from lightning_middleware.rewards.steps import completion_spans, token_rewards
from lightning_middleware.rows import Row, with_advantages
from trainer_backend.algorithms.registry import ADVANTAGE_LEVELS, OUTCOME, check_credit, get

# ---------------------------------------------------------------- outcome advantages


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


def _reinforce_pp(scores: torch.Tensor, groups: Sequence[Hashable], tokens: torch.Tensor, eps: float
                  ) -> torch.Tensor:
    centred = group_centre(scores, groups)
    size = Counter(groups)
    trained = torch.tensor([t > 0 and size[g] > 1 for g, t in zip(groups, tokens.tolist())])
    out = torch.zeros_like(centred)
    if trained.any():  # groups of one take no part: their advantage stays 0
        out[trained] = whiten_by_tokens(centred[trained], tokens[trained])
    return out


Estimator = Callable[[torch.Tensor, Sequence[Hashable], torch.Tensor, float], torch.Tensor]
# The outcome estimators by name (registry.OUTCOME): (scores, group ids, response tokens, eps) per sample.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": lambda s, g, t, eps: group_normalize(s, g, norm_by_std=True, eps=eps),
    "gspo": lambda s, g, t, eps: group_normalize(s, g, norm_by_std=True, eps=eps),
    "dr_grpo": lambda s, g, t, eps: group_normalize(s, g, norm_by_std=False),
    "rloo": lambda s, g, t, eps: group_centre(s, g, leave_one_out=True),
    "reinforce_pp": _reinforce_pp,
}


def estimate(algorithm: str, scores: torch.Tensor, groups: Sequence[Hashable], tokens: torch.Tensor,
             *, eps: float = 1e-6) -> torch.Tensor:
    """One advantage per sample (scores and token counts per sample, group ids)."""
    if algorithm not in ESTIMATORS:
        raise ValueError(f"unknown algorithm {algorithm!r}; one of {OUTCOME}")
    return ESTIMATORS[algorithm](scores, groups, tokens, eps)


def advantages_for(algorithm: str, rollouts: Sequence[Rollout], rows: Sequence[Row], *,
                   level: str = "rollout") -> list[float]:
    """One advantage per row, for `rollouts` (each with its final reward) and the rows built from them."""
    if level not in ADVANTAGE_LEVELS:
        raise ValueError(f"advantage level must be one of {ADVANTAGE_LEVELS}, not {level!r}")
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


# ---------------------------------------------------------------- DPO pairs


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


# ---------------------------------------------------------------- per-turn credit


EPS = 1e-6  # as group_normalize's


@dataclass(frozen=True)
class StepRewards:
    """What per-turn labelling takes from the store for a batch, by rollout id."""

    calls: Mapping[str, Sequence[LLMCall]]  # the rollout's calls (those of its rows among them)
    steps: Mapping[str, Mapping[int, float]]  # call index -> the per-step reward (summed)
    gamma: float = 1.0


def turn_returns(step_rewards: Sequence[float], final: float, gamma: float = 1.0) -> list[float]:
    """G_k per turn: s_k + gamma G_{k+1}, the last turn's s_K + final."""
    out = [0.0] * len(step_rewards)
    for k in reversed(range(len(step_rewards))):
        out[k] = step_rewards[k] + (final if k == len(step_rewards) - 1 else gamma * out[k + 1])
    return out


@dataclass(frozen=True)
class _Turn:
    rollout_id: str
    call_id: str | None  # None: a rollout without a trained call, standing in with R
    ret: float
    weight: float  # 1 / K_r: every rollout weighs 1 in its group
    tokens: int  # its response tokens in the rows


def per_turn_label(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], given: StepRewards) -> list[Row]:
    """`rows` (of `rollouts`, each with the reward it is trained on as `final_reward`) with
    per-turn advantages on their tokens (ppo: per-step token rewards) and `reward` set."""
    check_credit("per-turn", name, gamma=given.gamma if name != "ppo" else 1.0)
    reward = {r.id: float(r.final_reward or 0.0) for r in rollouts}
    if name == "ppo":
        return [dataclasses.replace(row, advantage=0.0, reward=reward[row.rollout_id],
                                    token_rewards=token_rewards(row, given.calls.get(row.rollout_id, ()),
                                                                given.steps.get(row.rollout_id, {})))
                for row in rows]
    turns = [_turns_of(r, [row for row in rows if row.rollout_id == r.id], given) for r in rollouts]
    adv = _turn_advantages(name, [r.task_id for r in rollouts], turns)
    return [_place(row, given.calls.get(row.rollout_id, ()), adv, reward[row.rollout_id]) for row in rows]


def _turns_of(rollout: Rollout, rows: Sequence[Row], given: StepRewards) -> list[_Turn]:
    """A rollout's trained calls in call order (its rows may interleave: agents, breaks), with returns."""
    tokens: dict[str, int] = defaultdict(int)
    calls: dict[str, LLMCall] = {}
    for row in rows:
        for span in completion_spans(row, given.calls.get(rollout.id, ())):
            calls[span.call.id] = span.call
            tokens[span.call.id] += sum(row.loss_mask[span.start:span.end])
    final = float(rollout.final_reward or 0.0)
    if not calls:
        return [_Turn(rollout.id, None, final, 1.0, 0)]
    ordered = sorted(calls.values(), key=lambda c: (c.call_index, c.attempt))
    steps = given.steps.get(rollout.id, {})
    returns = turn_returns([float(steps.get(c.call_index, 0.0)) for c in ordered], final, given.gamma)
    return [_Turn(rollout.id, c.id, g, 1.0 / len(ordered), tokens[c.id]) for c, g in zip(ordered, returns)]


def _turn_advantages(name: str, groups: Sequence[Hashable], turns: Sequence[list[_Turn]]
                     ) -> dict[tuple[str, str], float]:
    """(rollout id, call id) -> advantage, for every trained call."""
    members: dict[Hashable, list[list[_Turn]]] = defaultdict(list)
    for g, rollout_turns in zip(groups, turns):
        members[g].append(rollout_turns)
    values: dict[_Turn, float] = {}
    whitened: list[_Turn] = []  # reinforce_pp: the turns of groups of two or more
    for group in members.values():
        flat = [t for rollout_turns in group for t in rollout_turns]
        values.update(dict.fromkeys(flat, 0.0))
        if len(group) < 2:
            continue
        if name == "reinforce_pp":
            whitened += flat
        if len({t.ret for t in flat}) == 1:
            continue  # no signal (and no rounding noise either)
        values.update(_group_values(name, group))
    if name == "reinforce_pp":
        values.update(_whiten_turns({t: values[t] for t in whitened if t.tokens > 0}))
    return {(t.rollout_id, t.call_id): v for t, v in values.items() if t.call_id is not None}


def _group_values(name: str, group: Sequence[Sequence[_Turn]]) -> dict[_Turn, float]:
    """One group's per-turn values before any step-wide whitening (reinforce_pp's is centred only)."""
    n = len(group)
    flat = [t for rollout_turns in group for t in rollout_turns]
    mean = sum(t.weight * t.ret for t in flat) / n
    if name == "rloo":
        own = [sum(t.weight * t.ret for t in rollout_turns) for rollout_turns in group]
        return {t: t.ret - (n * mean - m) / (n - 1) for rollout_turns, m in zip(group, own) for t in rollout_turns}
    if name in ("dr_grpo", "reinforce_pp"):
        return {t: t.ret - mean for t in flat}
    if name in ("grpo", "gspo"):
        std = math.sqrt(sum(t.weight * (t.ret - mean) ** 2 for t in flat) / (n - 1))
        return {t: (t.ret - mean) / (std + EPS) for t in flat}
    raise ValueError(f"per-turn advantages for {name!r} are not defined; one of {', '.join(OUTCOME)}")


def _whiten_turns(values: Mapping[_Turn, float]) -> dict[_Turn, float]:
    """`whiten_by_tokens` over the turns: each turn's value counts once per response token of it."""
    turns = list(values)
    whitened = whiten_by_tokens(torch.tensor([values[t] for t in turns], dtype=torch.float64),
                                torch.tensor([t.tokens for t in turns], dtype=torch.float64))
    return {t: float(v) for t, v in zip(turns, whitened)}


def _place(row: Row, calls: Sequence[LLMCall], adv: Mapping[tuple[str, str], float], reward: float) -> Row:
    """The row with each call's advantage on its completion's tokens; `advantage` their token mean."""
    values = [0.0] * len(row)
    for span in completion_spans(row, calls):
        a = adv.get((row.rollout_id, span.call.id), 0.0)
        values[span.start:span.end] = [a] * (span.end - span.start)
    trained = [v for v, m in zip(values, row.loss_mask) if m]
    return dataclasses.replace(row, advantage=sum(trained) / len(trained) if trained else 0.0,
                               token_advantages=tuple(values), reward=reward)


def step_metrics(rows: Sequence[Row], given: StepRewards) -> dict[str, float]:
    """Per step: the per-step rewards on trained calls (used) and those on calls not trained
    (skipped, dropped, cut off: unused), their sum, and the number of trained calls."""
    trained: set[tuple[str, int]] = set()
    for row in rows:
        for span in completion_spans(row, given.calls.get(row.rollout_id, ())):
            trained.add((row.rollout_id, span.call.call_index))
    stored = {(rid, k): v for rid, steps in given.steps.items() for k, v in steps.items()}
    used = [v for key, v in stored.items() if key in trained]
    return {"step_rewards_used": float(len(used)), "step_rewards_unused": float(len(stored) - len(used)),
            "step_reward_sum": float(sum(used)), "turns": float(len(trained))}


class TurnCredit:
    def __init__(self, store: TraceStore, mode: str = "rollout", gamma: float = 1.0) -> None:
        self.store = store
        self.mode = mode
        self.gamma = gamma

    @property
    def per_turn(self) -> bool:
        return self.mode == "per-turn"

    def step_rewards(self, rollout_ids: Sequence[str]) -> dict[str, dict[int, float]]:
        """Per rollout, call index -> per-step reward; {} with rollout credit (nothing to read).
        A group whose rollouts agree on their final and per-step rewards has no signal."""
        return self.store.step_rewards(rollout_ids) if self.per_turn and rollout_ids else {}

    def for_batch(self, rollouts: Sequence[Rollout], calls: Mapping[str | None, Sequence[LLMCall]]
                  ) -> StepRewards | None:
        """What the labelling takes (None: rollout-level); `calls` by rollout id (`calls_for`)."""
        if not self.per_turn:
            return None
        return StepRewards(calls={r.id: calls.get(r.id, ()) for r in rollouts},
                                  steps=self.step_rewards([r.id for r in rollouts]), gamma=self.gamma)

    @staticmethod
    def metrics(rows: Sequence[Row], given: StepRewards | None) -> dict[str, float]:
        return step_metrics(rows, given) if given is not None else {}


# ---------------------------------------------------------------- PPO: GAE from the critic's values


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
    flat = torch.cat(adv) if adv else torch.zeros(0)
    flat = whiten_by_tokens(flat, torch.ones_like(flat))
    return list(flat.split([a.numel() for a in adv])), ret


# ---------------------------------------------------------------- a batch labelled: one policy, or each of a team's


def label_rows(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], *, level: str = "rollout"
               ) -> tuple[list[Row], list[float]]:
    """The rows to train and each one's advantage (DPO: its +1/-1 label; PPO: 0, the engine's
    critic computes them)."""
    kind = get(name).advantage
    if kind == "critic":
        return list(rows), [0.0] * len(rows)
    if kind == "pairs":
        have = {r.rollout_id for r in rows}
        pairs = [p for p in pairs_from_groups(rollouts) if p.chosen in have and p.rejected in have]
        labels: Mapping[str, float] = preference_advantages(pairs)
        kept = [r for r in rows if r.rollout_id in labels]
        return kept, [labels[r.rollout_id] for r in kept]
    return list(rows), advantages_for(name, rollouts, rows, level=level)


def label(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], *, level: str = "rollout",
          parts: Mapping[str, Sequence[Row]] | None = None,
          agent_rewards: Mapping[str, Mapping[str, float]] | None = None,
          credit: StepRewards | None = None) -> list[Row]:
    """The rows to train with their advantages (and `reward`) set.

    `parts` splits the rows by policy (`RoutesRows.route`); None labels them as one policy.
    `agent_rewards` is rollout id -> agent name -> reward (the store's per-agent rewards).
    `credit`: per-turn credit from these per-step rewards; None: rollout-level."""
    if parts is None:
        return _label_one(name, rollouts, rows, level, credit)
    rewarded = {agent for given in (agent_rewards or {}).values() for agent in given}
    out: list[Row] = []
    for policy_rows in parts.values():
        for agent, agent_rows in _by_rewarded_agent(policy_rows, rewarded).items():
            out.extend(_label_one(name, policy_rollouts(rollouts, agent_rows, agent, agent_rewards or {}),
                                  agent_rows, level, credit))
    return out


def policy_rollouts(rollouts: Sequence[Rollout], rows: Sequence[Row], agent: str | None,
                    agent_rewards: Mapping[str, Mapping[str, float]]) -> list[Rollout]:
    """The rollouts `rows` come from, each with the reward they are trained on as `final_reward`:
    `agent`'s own reward where it has one, else the rollout's."""
    ids = {row.rollout_id for row in rows}
    out = []
    for r in rollouts:
        if r.id not in ids:
            continue
        given = agent_rewards.get(r.id, {})
        out.append(dataclasses.replace(r, final_reward=given[agent]) if agent is not None and agent in given else r)
    return out


def _by_rewarded_agent(rows: Sequence[Row], rewarded: set[str]) -> dict[str | None, list[Row]]:
    """A policy's rows: those of each agent with its own rewards apart, the rest together (None)."""
    out: dict[str | None, list[Row]] = {}
    for row in rows:
        out.setdefault(row.agent if row.agent in rewarded else None, []).append(row)
    return out


def _label_one(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], level: str,
               credit: StepRewards | None) -> list[Row]:
    if credit is not None:
        return per_turn_label(name, rollouts, rows, credit)
    kept, adv = label_rows(name, rollouts, rows, level=level)
    return with_advantages(kept, adv, rewards={r.id: float(r.final_reward or 0.0) for r in rollouts})
