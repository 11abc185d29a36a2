"""Advantages per policy: groups are (task, policy), each policy sees its agents' rewards."""

from __future__ import annotations

import pytest

from lightning_middleware.records import Rollout
from lightning_middleware.rows import Row
from trainer_backend.algorithms.advantages import label, policy_rollouts


def _rollout(rid: str, task: str, reward: float) -> Rollout:
    return Rollout(id=rid, task_id=task, final_reward=reward)


def _row(rid: str, task: str, agent: str, policy: str) -> Row:
    return Row(rollout_id=rid, task_id=task, agent=agent, policy=policy, input_ids=(1, 2, 3),
               loss_mask=(0, 1, 1), behaviour_logprobs=None)


def _split(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(str(r.policy), []).append(r)
    return out


# two rollouts of one task; coder and reviewer act in both
ROLLOUTS = [_rollout("a", "t", 1.0), _rollout("b", "t", 0.0)]
ROWS = [_row("a", "t", "coder", "coder"), _row("a", "t", "reviewer", "reviewer"),
        _row("b", "t", "coder", "coder"), _row("b", "t", "reviewer", "reviewer")]


def _adv(rows: list[Row]) -> dict[tuple[str, str | None], float]:
    return {(r.rollout_id, r.policy): r.advantage for r in rows}


def test_without_agent_rewards_every_policy_sees_the_rollout_reward():
    adv = _adv(label("grpo", ROLLOUTS, ROWS, parts=_split(ROWS)))
    assert adv[("a", "coder")] == pytest.approx(adv[("a", "reviewer")]) and adv[("a", "coder")] > 0
    assert adv[("b", "coder")] < 0


def test_a_per_agent_reward_overrides_the_rollout_reward_for_that_policy_only():
    # the reviewer did better in b: its advantages flip, the coder's stay those of the rollout reward
    rewards = {"a": {"reviewer": 0.0}, "b": {"reviewer": 1.0}}
    adv = _adv(label("grpo", ROLLOUTS, ROWS, parts=_split(ROWS), agent_rewards=rewards))
    assert adv[("a", "coder")] > 0 > adv[("b", "coder")]
    assert adv[("a", "reviewer")] < 0 < adv[("b", "reviewer")]
    labelled = label("grpo", ROLLOUTS, ROWS, parts=_split(ROWS), agent_rewards=rewards)
    assert {(r.rollout_id, r.policy): r.reward for r in labelled}[("b", "reviewer")] == 1.0


def test_groups_are_task_and_policy_a_policy_absent_from_a_rollout_is_not_in_its_group():
    # the reviewer acted only in a: its group has one member, so its advantage is 0 (GRPO)
    rows = [r for r in ROWS if not (r.rollout_id == "b" and r.policy == "reviewer")]
    adv = _adv(label("grpo", ROLLOUTS, rows, parts=_split(rows)))
    assert adv[("a", "reviewer")] == 0.0 and ("b", "reviewer") not in adv
    assert adv[("a", "coder")] > 0 > adv[("b", "coder")]


def test_one_policy_playing_two_rewarded_roles_keeps_each_roles_baseline_apart():
    # a shared policy: each role's rows are labelled with its own reward against the same role
    rows = [_row("a", "t", "coder", "p"), _row("a", "t", "tester", "p"),
            _row("b", "t", "coder", "p"), _row("b", "t", "tester", "p")]
    rewards = {"a": {"coder": 1.0, "tester": 0.0}, "b": {"coder": 0.0, "tester": 1.0}}
    labelled = label("grpo", ROLLOUTS, rows, parts={"p": rows}, agent_rewards=rewards)
    adv = {(r.rollout_id, r.agent): r.advantage for r in labelled}
    assert adv[("a", "coder")] > 0 > adv[("b", "coder")]
    assert adv[("a", "tester")] < 0 < adv[("b", "tester")]
    got = policy_rollouts(ROLLOUTS, rows[:2], "tester", rewards)
    assert [(r.id, r.final_reward) for r in got] == [("a", 0.0)]


def test_an_unrewarded_agent_of_a_policy_keeps_the_rollout_reward():
    rows = [_row("a", "t", "coder", "p"), _row("a", "t", "planner", "p"),
            _row("b", "t", "coder", "p"), _row("b", "t", "planner", "p")]
    rewards = {"a": {"coder": 0.0}, "b": {"coder": 1.0}}  # rollout rewards: a 1.0, b 0.0
    adv = {(r.rollout_id, r.agent): r.advantage
           for r in label("grpo", ROLLOUTS, rows, parts={"p": rows}, agent_rewards=rewards)}
    assert adv[("a", "coder")] < 0 < adv[("b", "coder")]
    assert adv[("a", "planner")] > 0 > adv[("b", "planner")]


def test_one_policy_labels_the_batch_as_a_whole():
    whole = _adv(label("rloo", ROLLOUTS, ROWS))
    split = _adv(label("rloo", ROLLOUTS, ROWS, parts={"all": ROWS}))
    assert whole == split


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dpo"])
def test_every_algorithm_labels_each_policy_on_its_own_rewards(algo):
    rewards = {"a": {"reviewer": 0.0}, "b": {"reviewer": 1.0}}
    labelled = label(algo, ROLLOUTS, ROWS, parts=_split(ROWS), agent_rewards=rewards)
    adv = _adv(labelled)
    # whatever the algorithm, the reviewer's better rollout is b and the coder's is a
    assert adv[("b", "reviewer")] > adv[("a", "reviewer")]
    assert adv[("a", "coder")] > adv[("b", "coder")]
