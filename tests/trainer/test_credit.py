"""Per-turn credit (trainer_backend/algorithms/advantages.py): returns and advantages by hand, their
place on the tokens of real rows (merges, breaks, two agents, retries, truncation), groups of one,
equality with rollout-level credit without per-step rewards, verl's outcome advantages where the
two views meet (one call per rollout), and the configuration's refusals."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from lightning_middleware.records import LLMCall, Rollout
from lightning_middleware.rows import Row, build_rows_for_rollouts
from trainer_backend.algorithms import advantages, registry
from trainer_backend.algorithms.advantages import StepRewards, label, turn_returns, whiten_by_tokens
from trainer_backend.algorithms.registry import OUTCOME

TOL = 1e-6
EPS = 1e-6


def call(rid: str, i: int, prompt: list[int], completion: list[int], *, agent: str | None = None,
         model: str | None = None, attempt: int = 1, training: bool = True, partial: bool = False) -> LLMCall:
    return LLMCall(id=f"{rid}.{i}.{attempt}.{agent}", rollout_id=rid, call_index=i, attempt=attempt,
                   agent_name=agent, model=model, prompt_token_ids=tuple(prompt),
                   completion_token_ids=tuple(completion), logprobs=tuple(-0.5 for _ in completion),
                   is_training=training, partial=partial)


def three_turns(rid: str) -> list[LLMCall]:
    """Three calls that merge into one row: 1 2 [10 11] 20 [12] 30 [13 14] (completions in brackets)."""
    return [call(rid, 0, [1, 2], [10, 11]), call(rid, 1, [1, 2, 10, 11, 20], [12]),
            call(rid, 2, [1, 2, 10, 11, 20, 12, 30], [13, 14])]


SPANS = {0: (2, 4), 1: (5, 6), 2: (7, 9)}  # three_turns' completions in its row


def batch(spec: dict[str, tuple[str, float, list[LLMCall]]], steps: dict[str, dict[int, float]] | None = None,
          *, max_len: int | None = None, gamma: float = 1.0) -> tuple[list[Rollout], list[Row], StepRewards]:
    """rollout id -> (task, final reward, calls): the rollouts, their rows, the per-turn input."""
    rollouts = [Rollout(id=rid, task_id=task, final_reward=reward) for rid, (task, reward, _) in spec.items()]
    rows, _ = build_rows_for_rollouts(((r, spec[r.id][2]) for r in rollouts), max_len=max_len)
    return rollouts, rows, StepRewards(calls={rid: c for rid, (_, _, c) in spec.items()}, steps=steps or {},
                                       gamma=gamma)


def per_turn(name: str, rollouts, rows, given, **kw) -> list[Row]:
    return label(name, rollouts, rows, credit=given, **kw)


def adv_at(rows: list[Row], rid: str, position: int, row_index: int = 0) -> float:
    mine = [r for r in rows if r.rollout_id == rid]
    assert mine[row_index].token_advantages is not None
    return mine[row_index].token_advantages[position]


# ---------------------------------------------------------------- returns


def test_turn_returns_by_hand():
    assert turn_returns([0.5, 0.0, -0.2], 1.0) == pytest.approx([1.3, 0.8, 0.8])
    # gamma 0.5: G2 = -0.2 + 1, G1 = 0 + 0.5 G2, G0 = 0.5 + 0.5 G1
    assert turn_returns([0.5, 0.0, -0.2], 1.0, 0.5) == pytest.approx([0.7, 0.4, 0.8])
    assert turn_returns([], 1.0) == [] and turn_returns([0.0], 2.0) == [2.0]


# ---------------------------------------------------------------- advantages by hand, on merged rows


def test_grpo_per_turn_on_a_merged_row_by_hand():
    rollouts, rows, given = batch({"a": ("t", 1.0, three_turns("a")), "b": ("t", 0.0, three_turns("b"))},
                                  {"a": {0: 0.5, 2: -0.25}})  # call 1 has no per-step reward
    out = per_turn("grpo", rollouts, rows, given)
    g_a = [1.25, 0.75, 0.75]  # G0 = 0.5 + G1, G1 = 0 + G2, G2 = -0.25 + 1
    mean = (sum(g_a) / 3 + 0.0) / 2  # each rollout weighs once: 11/24
    var = (sum((g - mean) ** 2 for g in g_a) / 3 + mean ** 2) / (2 - 1)
    std = math.sqrt(var)
    [row_a] = [r for r in out if r.rollout_id == "a"]
    expected = [0.0] * len(row_a)
    for k, (start, end) in SPANS.items():
        expected[start:end] = [(g_a[k] - mean) / (std + EPS)] * (end - start)
    assert row_a.token_advantages == pytest.approx(expected, abs=TOL)  # 0 on prompt and observation tokens
    [row_b] = [r for r in out if r.rollout_id == "b"]
    assert [row_b.token_advantages[p] for p in (2, 3, 5, 7, 8)] == pytest.approx([(0 - mean) / (std + EPS)] * 5)
    assert row_a.reward == 1.0 and row_b.reward == 0.0
    trained = [a for a, m in zip(expected, row_a.loss_mask) if m]
    assert row_a.advantage == pytest.approx(sum(trained) / len(trained))  # the row's summary: token mean


def test_discounting_by_turns():
    rollouts, rows, given = batch({"a": ("t", 1.0, three_turns("a")), "b": ("t", 0.0, three_turns("b"))},
                                  {"a": {0: 1.0}}, gamma=0.5)
    out = per_turn("dr_grpo", rollouts, rows, given)
    g_a = [1.0 + 0.25, 0.5, 1.0]  # G2 = R, G1 = 0.5 G2, G0 = 1 + 0.5 G1
    g_b = [0.0, 0.0, 0.0]
    mean = (sum(g_a) / 3 + sum(g_b) / 3) / 2
    for k, (start, _) in SPANS.items():
        assert adv_at(out, "a", start) == pytest.approx(g_a[k] - mean, abs=TOL)
        assert adv_at(out, "b", start) == pytest.approx(-mean, abs=TOL)


def test_rloo_per_turn_by_hand():
    one = lambda rid: [call(rid, 0, [1, 2], [10, 11])]  # noqa: E731
    two = [call("a", 0, [1, 2], [10, 11]), call("a", 1, [1, 2, 10, 11, 20], [12])]
    rollouts, rows, given = batch({"a": ("t", 1.0, two), "b": ("t", 0.0, one("b")), "c": ("t", 1.0, one("c"))},
                                  {"a": {0: 0.5}})
    out = per_turn("rloo", rollouts, rows, given)
    # a: G = [1.5, 1.0] (mean 1.25); b: 0; c: 1. Baseline: the mean of the other rollouts' mean returns
    assert adv_at(out, "a", 2) == pytest.approx(1.5 - (0 + 1) / 2, abs=TOL)
    assert adv_at(out, "a", 5) == pytest.approx(1.0 - (0 + 1) / 2, abs=TOL)
    assert adv_at(out, "b", 2) == pytest.approx(0 - (1.25 + 1) / 2, abs=TOL)
    assert adv_at(out, "c", 2) == pytest.approx(1 - (1.25 + 0) / 2, abs=TOL)


def test_reinforce_pp_whitens_the_turns_over_the_steps_tokens():
    rollouts, rows, given = batch({"a": ("t", 1.0, three_turns("a")), "b": ("t", 0.0, three_turns("b")),
                                   "solo": ("u", 1.0, three_turns("solo"))}, {"a": {1: 2.0}, "b": {0: -1.0}})
    out = per_turn("reinforce_pp", rollouts, rows, given)
    g = {"a": [3.0, 3.0, 1.0], "b": [-1.0, 0.0, 0.0]}
    mean = (sum(g["a"]) / 3 + sum(g["b"]) / 3) / 2
    tokens = [2, 1, 2]  # per call of three_turns
    values = torch.tensor([x - mean for rid in "ab" for x in g[rid]], dtype=torch.float64)
    ref = whiten_by_tokens(values, torch.tensor(tokens * 2, dtype=torch.float64))  # the rollout-level helper
    got = [adv_at(out, rid, SPANS[k][0]) for rid in "ab" for k in range(3)]
    assert got == pytest.approx(ref.tolist(), abs=TOL)
    assert all(a == 0.0 for a in out[-1].token_advantages)  # a group of one takes no part


# ---------------------------------------------------------------- rows: breaks, agents, retries, truncation


def test_a_prefix_break_keeps_the_rollouts_turns_in_call_order():
    calls = [call("a", 0, [1, 2], [10]), call("a", 1, [5, 6], [11]),  # call 1 rewrote the context: a break
             call("a", 2, [5, 6, 11, 7], [12])]
    rollouts, rows, given = batch({"a": ("t", 0.0, calls), "b": ("t", 0.0, [call("b", 0, [1, 2], [10])])},
                                  {"a": {2: 1.0}})
    out = per_turn("dr_grpo", rollouts, rows, given)
    assert len([r for r in out if r.rollout_id == "a"]) == 2
    mean = (1.0 + 0.0) / 2  # a's turns all return 1 (the step reward of its last call), b's 0
    assert adv_at(out, "a", 2, row_index=0) == pytest.approx(1.0 - mean)  # the first row sees the later reward
    assert adv_at(out, "a", 2, row_index=1) == adv_at(out, "a", 4, row_index=1) == pytest.approx(1.0 - mean)


def _two_agents(rid: str, model_b: str | None = None) -> list[LLMCall]:
    """Agent A's calls 0 and 2 merge into one row; agent B's call 1 is its own row."""
    return [call(rid, 0, [1, 2], [10], agent="A", model="pa" if model_b else None),
            call(rid, 1, [3, 4], [20], agent="B", model=model_b),
            call(rid, 2, [1, 2, 10, 5], [11], agent="A", model="pa" if model_b else None)]


def test_two_agents_one_policy_share_the_rollouts_turns():
    rollouts, rows, given = batch({"a": ("t", 0.0, _two_agents("a")), "b": ("t", 0.0, _two_agents("b"))},
                                  {"a": {1: 1.0}})  # B's call in a
    out = per_turn("dr_grpo", rollouts, rows, given)
    by = {(r.rollout_id, r.agent): r for r in out}
    # a's turns in call order: A0 (G 1), B1 (G 1), A2 (G 0); b's all 0. mean = (2/3) / 2
    mean = 1 / 3
    assert by[("a", "A")].token_advantages[2] == pytest.approx(1 - mean)  # A's earlier call gets B's reward
    assert by[("a", "B")].token_advantages[2] == pytest.approx(1 - mean)
    assert by[("a", "A")].token_advantages[4] == pytest.approx(0 - mean)
    assert by[("b", "A")].token_advantages[2] == pytest.approx(0 - mean)


def test_separate_policies_take_only_their_own_calls_per_step_rewards():
    rollouts, rows, given = batch({"a": ("t", 0.0, _two_agents("a", "pb")), "b": ("t", 0.0, _two_agents("b", "pb"))},
                                  {"a": {1: 1.0}})
    parts: dict[str, list[Row]] = {}
    for r in rows:
        parts.setdefault(str(r.policy), []).append(r)
    out = per_turn("dr_grpo", rollouts, rows, given, parts=parts, agent_rewards={})
    by = {(r.rollout_id, r.agent): r for r in out}
    assert all(a == 0.0 for key in (("a", "A"), ("b", "A")) for a in by[key].token_advantages)  # no signal for pa
    assert by[("a", "B")].token_advantages[2] == pytest.approx(0.5) and by[("b", "B")].token_advantages[2] == -0.5


def test_a_retried_call_counts_once_with_the_attempt_that_trained():
    calls = [call("a", 0, [1, 2], [10]), call("a", 1, [1, 2, 10, 7], [99], training=False),  # failed attempt
             call("a", 1, [1, 2, 10, 7], [11], attempt=2)]
    rollouts, rows, given = batch({"a": ("t", 0.0, calls), "b": ("t", 0.0, [call("b", 0, [1, 2], [10])])},
                                  {"a": {1: 1.0}})
    out = per_turn("dr_grpo", rollouts, rows, given)
    [row_a] = [r for r in out if r.rollout_id == "a"]
    assert row_a.input_ids == (1, 2, 10, 7, 11) and row_a.call_ids == ("a.0.1.None", "a.1.2.None")
    mean = (1.0 + 0.0) / 2  # two turns of a, both returning 1 (not three: the failed attempt is no turn)
    assert row_a.token_advantages == pytest.approx((0, 0, 1 - mean, 0, 1 - mean))
    m = advantages.step_metrics(out, given)
    assert m == {"step_rewards_used": 1.0, "step_rewards_unused": 0.0, "step_reward_sum": 1.0, "turns": 3.0}


def test_a_call_cut_off_by_max_len_still_pays_its_reward_to_the_earlier_turns():
    rollouts, rows, given = batch({"a": ("t", 0.0, three_turns("a")), "b": ("t", 0.0, three_turns("b"))},
                                  {"a": {2: 3.0}}, max_len=6)  # keeps 1 2 [10 11] 20 [12]
    out = per_turn("dr_grpo", rollouts, rows, given)
    row_a = next(r for r in out if r.rollout_id == "a")
    assert len(row_a) == 6 and row_a.truncated
    # a's three turns return 3 (the cut call's reward too), b's 0: the group mean is 1.5
    assert row_a.token_advantages == pytest.approx((0, 0, 1.5, 1.5, 0, 1.5))
    assert advantages.step_metrics(out, given)["step_rewards_used"] == 1.0


def test_step_rewards_of_calls_not_trained_are_counted_unused():
    calls = three_turns("a")[:2] + [call("a", 2, [1, 2, 10, 11, 20, 12, 30], [13], partial=True)]
    rollouts, rows, given = batch({"a": ("t", 1.0, calls), "b": ("t", 0.0, three_turns("b"))},
                                  {"a": {0: 0.5, 2: 1.0}})
    out = per_turn("grpo", rollouts, rows, given)
    assert advantages.step_metrics(out, given) == {"step_rewards_used": 1.0, "step_rewards_unused": 1.0,
                                               "step_reward_sum": 0.5, "turns": 5.0}
    g_a = [1.5, 1.0]  # the partial call is no turn: its reward is not in a's returns
    mean = (sum(g_a) / 2 + 0) / 2
    std = math.sqrt(sum((g - mean) ** 2 for g in g_a) / 2 + mean ** 2)
    assert adv_at(out, "a", 2) == pytest.approx((1.5 - mean) / (std + EPS), abs=TOL)


# ---------------------------------------------------------------- no signal


@pytest.mark.parametrize("name", OUTCOME)
def test_groups_of_one_and_uniform_groups_get_zero(name):
    rollouts, rows, given = batch({"solo": ("s", 1.0, three_turns("solo")),
                                   "a": ("t", 1.0, three_turns("a")), "b": ("t", 0.0, three_turns("b")),
                                   "u1": ("u", 0.5, three_turns("u1")), "u2": ("u", 0.0, three_turns("u2"))},
                                  {"solo": {0: 1.0}, "u2": {2: 0.5}})  # u: every return is 0.5
    out = {r.rollout_id: r for r in per_turn(name, rollouts, rows, given)}
    assert set(out["solo"].token_advantages) == {0.0}
    uniform = {a for rid in ("u1", "u2") for a, m in zip(out[rid].token_advantages, out[rid].loss_mask) if m}
    # reinforce_pp whitens a uniform group's zeros with the step (as at rollout level); the daemon skips it
    assert uniform == {0.0} if name != "reinforce_pp" else len(uniform) == 1
    assert any(a != 0 for a in out["a"].token_advantages)


# ---------------------------------------------------------------- without per-step rewards: rollout-level


def _random_batch(seed: int) -> dict[str, tuple[str, float, list[LLMCall]]]:
    """Groups of 1-5 rollouts with 1-4 calls each: merges, breaks, two agents, partial calls."""
    rng = random.Random(seed)
    spec = {}
    for g in range(5):
        for j in range(rng.randint(1, 5)):
            rid = f"g{g}r{j}"
            calls, context = [], {"A": [1, 2], "B": [3]}
            for i in range(rng.randint(1, 4)):
                agent = rng.choice("AB")
                if rng.random() < 0.2:
                    context[agent] = [rng.randint(1, 40)]  # a rewritten context: a prefix break
                comp = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
                calls.append(call(rid, i, context[agent], comp, agent=agent, partial=rng.random() < 0.1))
                context[agent] = context[agent] + comp + [rng.randint(1, 40)]
            spec[rid] = (f"g{g}", float(rng.choice([0, 0.5, 1, 2])), calls)
    return spec


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", OUTCOME)
def test_per_turn_without_step_rewards_equals_rollout_level(name, seed):
    rollouts, rows, given = batch(_random_batch(seed))
    roll = label(name, rollouts, rows)
    turn = per_turn(name, rollouts, rows, given)
    assert len(roll) == len(turn)
    for r, t in zip(roll, turn):
        assert (r.rollout_id, r.input_ids, r.reward) == (t.rollout_id, t.input_ids, t.reward)
        on_response = [a for a, m in zip(t.token_advantages, t.loss_mask) if m]
        assert on_response == pytest.approx([r.advantage] * len(on_response), abs=TOL)
        assert t.advantage == pytest.approx(r.advantage, abs=TOL)


def _mask_runs(row: Row) -> list[list[int]]:
    """The positions of each run of trained tokens: one run per call in `_random_batch`'s rows (an
    observation token always follows a completion there)."""
    runs: list[list[int]] = []
    for i, m in enumerate(row.loss_mask):
        if m and (i == 0 or not row.loss_mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(i)
    return runs


@pytest.mark.parametrize("seed", range(4))
def test_per_turn_grpo_with_step_rewards_on_random_batches_against_the_closed_form(seed):
    spec = _random_batch(seed)
    rng = random.Random(100 + seed)
    steps = {rid: {c.call_index: rng.choice([-1.0, 0.5, 2.0]) for c in calls if rng.random() < 0.5}
             for rid, (_, _, calls) in spec.items()}
    gamma = 0.8
    rollouts, rows, given = batch(spec, steps, gamma=gamma)
    index_of = {c.id: c.call_index for _, _, calls in spec.values() for c in calls}
    # G_k = sum_{j >= k} gamma^(j-k) s_j + gamma^(K-k) R, over the rollout's trained calls
    returns: dict[str, dict[int | None, float]] = {}
    for rid, (_, final, _) in spec.items():
        ks = sorted(index_of[c] for row in rows if row.rollout_id == rid for c in row.call_ids)
        returns[rid] = {k: sum(gamma ** j * steps[rid].get(kk, 0.0) for j, kk in enumerate(ks[i:]))
                        + gamma ** (len(ks) - 1 - i) * final for i, k in enumerate(ks)} or {None: final}
    expected: dict[tuple[str, int | None], float] = {}
    for task in {t for t, _, _ in spec.values()}:
        members = [rid for rid, (t, _, _) in spec.items() if t == task]
        samples = [(rid, k, g, 1 / len(returns[rid])) for rid in members for k, g in returns[rid].items()]
        n = len(members)
        mean = sum(w * g for _, _, g, w in samples) / n
        std = math.sqrt(sum(w * (g - mean) ** 2 for _, _, g, w in samples) / (n - 1)) if n > 1 else 0.0
        uniform = len({g for _, _, g, _ in samples}) == 1
        for rid, k, g, _ in samples:
            expected[(rid, k)] = 0.0 if n < 2 or uniform else (g - mean) / (std + EPS)
    for row in per_turn("grpo", rollouts, rows, given):
        runs = _mask_runs(row)
        assert len(runs) == len(row.call_ids)
        for call_id, positions in zip(row.call_ids, runs):
            want = expected[(row.rollout_id, index_of[call_id])]
            assert [row.token_advantages[p] for p in positions] == pytest.approx([want] * len(positions), abs=TOL)


def test_ppo_per_turn_sets_token_rewards_and_no_advantages():
    rollouts, rows, given = batch({"a": ("t", 1.0, three_turns("a")), "b": ("t", 0.0, three_turns("b"))},
                                  {"a": {0: 0.5, 1: -1.0}})
    out = {r.rollout_id: r for r in per_turn("ppo", rollouts, rows, given)}
    assert out["a"].token_rewards == (0, 0, 0, 0.5, 0, -1.0, 0, 0, 0)  # at each call's last completion token
    assert out["b"].token_rewards == (0.0,) * 9 and out["a"].reward == 1.0
    assert out["a"].advantage == 0.0 and out["a"].token_advantages is None  # the critic decides


# ---------------------------------------------------------------- verl: one call per rollout


@pytest.mark.parametrize("seed", range(3))
def test_one_call_per_rollout_matches_verl_on_summed_token_rewards(seed):
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    rng = random.Random(seed)
    spec, steps = {}, {}
    for j in range(12):
        rid = f"r{j}"
        spec[rid] = (f"t{j // 4}", float(rng.choice([0, 1])), [call(rid, 0, [1, 2], [10 + j, 11, 12][:1 + j % 3])])
        if rng.random() < 0.6:
            steps[rid] = {0: rng.choice([-0.5, 0.25, 1.0])}
    rollouts, rows, given = batch(spec, steps)
    # verl's view: the per-step reward and the final reward on the response's last token, summed per sample
    T = max(r.n_response_tokens for r in rows)
    token_level = torch.zeros(len(rows), T)
    mask = torch.zeros(len(rows), T)
    for b, row in enumerate(rows):
        n = row.n_response_tokens
        mask[b, :n] = 1
        token_level[b, n - 1] = spec[row.rollout_id][1] + steps.get(row.rollout_id, {}).get(0, 0.0)
    index = np.array([spec[row.rollout_id][0] for row in rows])
    ref, _ = core.compute_grpo_outcome_advantage(token_level, mask, index)
    ref_pp, _ = core.compute_reinforce_plus_plus_baseline_outcome_advantage(token_level, mask, index)
    for name, expected in (("grpo", ref), ("reinforce_pp", ref_pp)):
        for b, row in enumerate(per_turn(name, rollouts, rows, given)):
            got = [a for a, m in zip(row.token_advantages, row.loss_mask) if m]
            assert got == pytest.approx(expected[b, :row.n_response_tokens].tolist(), abs=1e-5), name


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(("kw", "message"), [
    (dict(credit="per-turn", algorithm="dpo"), "'dpo' compares whole rollouts"),
    (dict(credit="per-turn", algorithm="grpo", level="sample"), "keep advantage_level 'rollout'"),
    (dict(credit="per-turn", algorithm="ppo", gamma=0.9), "leave credit_gamma at 1"),
    (dict(credit="per-turn", algorithm="rloo", kl_in_reward=True), "with ppo only"),
    (dict(credit="rollout", algorithm="grpo", gamma=0.9), "needs credit = 'per-turn'"),
    (dict(credit="per-call", algorithm="grpo"), "credit must be one of rollout, per-turn"),
    (dict(credit="per-turn", algorithm="grpo", gamma=0.0), "credit_gamma must be in (0, 1]"),
])
def test_unsupported_combinations_are_refused_by_name(kw, message):
    c, a = kw.pop("credit"), kw.pop("algorithm")
    with pytest.raises(ValueError) as err:
        registry.check_credit(c, a, **kw)
    assert message in str(err.value)


def test_every_other_combination_is_accepted():
    for name in registry.PER_TURN_ALGORITHMS:
        assert registry.check_credit("per-turn", name, kl_in_reward=name == "ppo") == "per-turn"
    assert registry.check_credit("rollout", "dpo", level="sample") == "rollout"


def test_the_flags_and_the_file_reach_the_daemon(tmp_path):
    import argparse

    from trainer_backend.daemon.cli import add_cli, settings_from
    from trainer_backend.daemon.settings import SettingsError, TrainerSettings

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["trainer", "--credit", "per-turn", "--credit-gamma", "0.9", "--algo", "rloo"])
    config = settings_from(args).trainer_config()
    assert (config.credit, config.credit_gamma, config.algorithm) == ("per-turn", 0.9, "rloo")
    assert TrainerSettings().trainer_config().credit == "rollout"  # the default
    path = tmp_path / "trainer.toml"
    path.write_text('[algorithm]\nname = "dpo"\ncredit = "per-turn"\n')
    with pytest.raises(SettingsError) as err:
        TrainerSettings.load(path)
    assert "algorithm.credit: credit 'per-turn' needs per-token advantages" in str(err.value)
    path.write_text('[algorithm]\ncredit = "per-step"\n')
    with pytest.raises(SettingsError, match="algorithm.credit: Input should be 'rollout' or 'per-turn'"):
        TrainerSettings.load(path)
