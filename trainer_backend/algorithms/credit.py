"""Per-turn credit: every call (turn) of a rollout gets its own advantage, from its return.

    credit = "rollout"   (the default) one advantage per rollout, from its final reward R
                         (advantages.py); every response token of the rollout gets it.
    credit = "per-turn"  one advantage per call k of rollout r, from the call's return

        G_rk = s_rk + gamma G_r,k+1,     G_rK = s_rK + R_r       (K_r trained calls, in call order)

    i.e. the per-step rewards s (`emit_reward(v, call_index=...)`) of that call and the later
    ones, discounted by turns (`credit_gamma`, default 1: G_rk = R_r + sum_{j>=k} s_rj), and the
    final reward as the last turn's. Group statistics weigh each rollout once (a turn 1/K_r):

        mean_g = (1/n) sum_r (1/K_r) sum_k G_rk
        var_g  = 1/(n-1) sum_r (1/K_r) sum_k (G_rk - mean_g)^2

    so without per-step rewards (and gamma 1) every G_rk = R_r and the advantages are the
    rollout-level ones. Then, as the algorithm does with rewards:

        grpo, gspo    (G - mean_g) / (std_g + eps)
        dr_grpo       G - mean_g
        rloo          G - mean of the other rollouts' mean returns (1/(n-1) sum_{r' != r} mean_k G_r'k)
        reinforce_pp  G - mean_g, whitened over the step's response tokens (each turn's tokens)
        ppo           no advantage here: each per-step reward is a token reward at the last token
                      of its call's completion, inside GAE (the critic is the baseline)

    Groups of one and groups whose returns are all equal get 0, as with rollout credit (before
    reinforce_pp's whitening, which takes the latter in, as at rollout level). A
    rollout without a trained call stands in its group's statistics with R_r, weight 1. A call's
    advantage goes to the tokens of its completion in its row (`rewards.steps.completion_spans`):
    a merged row holding several calls has different advantages on their tokens.

Light (no torch): the daemon's configuration checks with it. docs/trainer.md, "Per-turn credit".
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from lightning_middleware.records import LLMCall, Rollout
from lightning_middleware.rewards.steps import completion_spans, token_rewards
from lightning_middleware.rows import Row
from trainer_backend.algorithms.registry import OUTCOME
from trainer_backend.algorithms.registry import check as check_algorithm

CREDITS = ("rollout", "per-turn")
PER_TURN_ALGORITHMS = (*OUTCOME, "ppo")
EPS = 1e-6  # as group_normalize's
WHITEN_EPS = 1e-8  # as whiten_by_tokens' (verl's masked_whiten)


def check(credit: str, algorithm: str, *, level: str = "rollout", gamma: float = 1.0,
          kl_in_reward: bool = False) -> str:
    """The credit mode, if it goes with the rest of the configuration; else a ValueError saying why."""
    if credit not in CREDITS:
        raise ValueError(f"credit must be one of {', '.join(CREDITS)}, not {credit!r}")
    if not 0 < gamma <= 1:
        raise ValueError(f"credit_gamma must be in (0, 1], got {gamma}")
    if credit == "rollout":
        if gamma != 1:
            raise ValueError("credit_gamma discounts per-turn returns: it needs credit = 'per-turn'")
        return credit
    check_algorithm(algorithm)
    if algorithm not in PER_TURN_ALGORITHMS:
        raise ValueError(f"credit 'per-turn' needs per-token advantages ({', '.join(PER_TURN_ALGORITHMS)}); "
                         f"{algorithm!r} compares whole rollouts: use credit 'rollout'")
    if level != "rollout":
        raise ValueError("credit 'per-turn' makes every call a sample; advantage_level 'sample' (every row) "
                         "is another view: keep advantage_level 'rollout'")
    if algorithm == "ppo" and gamma != 1:
        raise ValueError("with ppo, GAE discounts the per-step rewards per token (critic.gamma): "
                         "leave credit_gamma at 1")
    if kl_in_reward and algorithm != "ppo":
        raise ValueError(f"credit 'per-turn' with the KL in the reward runs with ppo only; "
                         f"with {algorithm!r} put the KL in the loss (loss.kl_in = 'loss')")
    return credit


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


def label(name: str, rollouts: Sequence[Rollout], rows: Sequence[Row], given: StepRewards) -> list[Row]:
    """`rows` (of `rollouts`, each with the reward it is trained on as `final_reward`) with
    per-turn advantages on their tokens (ppo: per-step token rewards) and `reward` set."""
    check("per-turn", name, gamma=given.gamma if name != "ppo" else 1.0)
    reward = {r.id: float(r.final_reward or 0.0) for r in rollouts}
    if name == "ppo":
        return [dataclasses.replace(row, advantage=0.0, reward=reward[row.rollout_id],
                                    token_rewards=token_rewards(row, given.calls.get(row.rollout_id, ()),
                                                                given.steps.get(row.rollout_id, {})))
                for row in rows]
    turns = [_turns_of(r, [row for row in rows if row.rollout_id == r.id], given) for r in rollouts]
    adv = _advantages(name, [r.task_id for r in rollouts], turns)
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


def _advantages(name: str, groups: Sequence[Hashable], turns: Sequence[list[_Turn]]) -> dict[tuple[str, str], float]:
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
        values.update(_whiten_by_tokens({t: values[t] for t in whitened if t.tokens > 0}))
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


def _whiten_by_tokens(values: Mapping[_Turn, float]) -> dict[_Turn, float]:
    """advantages.whiten_by_tokens over the turns: mean and unbiased variance over their tokens."""
    n = sum(t.tokens for t in values)
    if n < 2:
        return dict.fromkeys(values, 0.0)
    mean = sum(t.tokens * v for t, v in values.items()) / n
    var = sum(t.tokens * (v - mean) ** 2 for t, v in values.items()) / (n - 1)
    return {t: (v - mean) / math.sqrt(var + WHITEN_EPS) for t, v in values.items()}


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
