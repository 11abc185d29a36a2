"""Per-step rewards (stored, summed, placed on the trainer's tokens), re-scoring stored rollouts
under a new configuration without losing the old values, and calibration against human labels;
on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from lightning_middleware import Reward, RewardConfig, TraceStore, emit_reward, rollout
from lightning_middleware.records import TrainStep
from lightning_middleware.rewards import calibration, rescore, token_rewards
from lightning_middleware.rows import build_rows
from tests.rewards.helpers import client_for, tool_agent

RULES_A = {"rules": {"agent_reward": 1.0}}
RULES_B = {"rules": {"agent_reward": 2.0, "tool_call_valid": 1.0, "step_reward_sum": 1.0}}


def test_per_step_rewards_are_stored_and_land_on_the_last_token_of_their_call(store: TraceStore) -> None:
    client = client_for(store)
    with rollout("t", store=store) as r:
        assert r.last_call_index is None
        tool_agent(client, "q", "ok")
        r.reward(0.25, call_index=0, name="format")  # the first turn's own reward
        emit_reward(-0.5, call_index=r.last_call_index)  # the turn just made
        r.reward(1.0)  # the outcome
    assert r.last_call_index == 1
    steps = store.step_rewards([r.id])
    assert steps == {r.id: {0: 0.25, 1: -0.5}} and store.get_rollout(r.id).final_reward == 1.0
    assert [(x.call_index, x.final) for x in store.rewards(r.id)] == [(0, False), (1, False), (None, True)]

    calls = store.calls(r.id, training_only=True)
    [row], _ = build_rows(calls, rollout_id=r.id)
    per_token = token_rewards(row, calls, steps[r.id])
    assert len(per_token) == len(row) and sorted(x for x in per_token if x) == [-0.5, 0.25]
    first_end = len(calls[0].prompt_token_ids) + len(calls[0].completion_token_ids) - 1
    assert per_token[first_end] == 0.25 and row.loss_mask[first_end] == 1 and row.loss_mask[first_end + 1] == 0
    assert per_token[-1] == -0.5 and row.loss_mask[-1] == 1
    # A row cut inside the second call's completion keeps its reward on the last kept token.
    [cut], _ = build_rows(calls, rollout_id=r.id, max_len=len(row) - 3)
    assert token_rewards(cut, calls, steps[r.id])[-1] == -0.5


def test_a_per_step_reward_is_checked(tmp_path) -> None:  # noqa: ANN001
    store = TraceStore(f"sqlite:///{tmp_path / 'steps.db'}")
    try:
        _per_step_reward_is_checked(store)
    finally:
        store.close()


def _per_step_reward_is_checked(store: TraceStore) -> None:
    with rollout("t", store=store) as r:
        with pytest.raises(ValueError, match="cannot be final"):
            r.reward(1.0, call_index=0, final=True)
        with pytest.raises(ValueError, match="call_index"):
            r.reward(1.0, call_index=-1)
        with pytest.raises(ValueError, match="finite"):
            r.reward(float("inf"))


def _agent_rollouts(store: TraceStore, values: list[float]) -> list[str]:
    client = client_for(store)
    ids = []
    for v in values:
        with rollout("g", store=store, rewards=RewardConfig.from_dict(RULES_A)) as r:
            tool_agent(client, "q", "ok")
            r.reward(v)
            r.reward(0.5, call_index=0)
        ids.append(r.id)
    return ids


def test_rescore_stores_the_new_configuration_beside_the_old(store: TraceStore) -> None:
    a, b = RewardConfig.from_dict(RULES_A), RewardConfig.from_dict(RULES_B)
    ids = _agent_rollouts(store, [1.0, 0.0, 0.5])
    assert [store.get_rollout(i).final_reward for i in ids] == [1.0, 0.0, 0.5]
    store.claim_rollouts([ids[0]], "trainer0")  # the first one was trained on under A
    store.commit_train_step(TrainStep(step=1, rollout_ids=(ids[0],), trainer_id="trainer0"))
    before = {i: [(x.name, x.value, x.config_hash) for x in store.rewards(i)] for i in ids}

    seen = []
    report = rescore(store, b, on_rollout=lambda rid, final: seen.append((rid, final)))
    assert (report.config_hash, report.rollouts, report.with_final, report.applied) == (b.hash, 3, 3, 2)
    assert seen == [(i, 2 * v + 1.0 + 0.5) for i, v in zip(ids, [1.0, 0.0, 0.5])]
    for i in ids:  # nothing of before is lost: the old rows are a prefix of the new list
        assert [(x.name, x.value, x.config_hash) for x in store.rewards(i)][:len(before[i])] == before[i]
        new = {x.name: x.value for x in store.rewards(i) if x.config_hash == b.hash}
        assert set(new) == {"agent_reward", "tool_call_valid", "step_reward_sum", "final"}
        assert {x.name for x in store.rewards(i) if x.config_hash == a.hash} == {"agent_reward", "final"}
    # The consumed rollout keeps the reward it was trained on; the others take the new one.
    assert [store.get_rollout(i).final_reward for i in ids] == [1.0, 1.5, 2.5]
    # Re-scoring again changes nothing and writes nothing.
    assert rescore(store, b).rewards_written == 0
    # --apply none: stored beside, final_reward untouched; --apply all: even the consumed one.
    c = RewardConfig.from_dict({"rules": {"agent_reward": 10.0}})
    rescore(store, c, apply="none")
    assert [store.get_rollout(i).final_reward for i in ids] == [1.0, 1.5, 2.5]
    rescore(store, c, rollout_ids=[ids[0]], apply="all")
    assert store.get_rollout(ids[0]).final_reward == 10.0
    with pytest.raises(KeyError, match="no rollouts"):
        rescore(store, c, rollout_ids=["nope"])


def test_calibration_fits_the_labels(store: TraceStore) -> None:
    cfg = RewardConfig.from_dict({"reward_type": "model", "reward_model": {
        "scorer": lambda t: t.reported_reward, "weight": 1.0}})
    client = client_for(store)
    ids = []
    for v in (0.2, 0.4, 0.6, 0.8):
        with rollout("g", store=store, rewards=cfg) as r:
            tool_agent(client, "q", "ok")
            r.reward(v)
        ids.append(r.id)
    with pytest.raises(ValueError, match="at least 2"):
        calibration(store)
    for rid, v in zip(ids, (0.2, 0.4, 0.6, 0.8)):
        store.add_reward(Reward(rid, 0.5 * v + 0.1, name="human", final=False))  # people are harsher
    cal = calibration(store, config_hash=cfg.hash)
    assert cal.n == 4 and cal.slope == pytest.approx(0.5) and cal.intercept == pytest.approx(0.1)
    assert cal.bias == pytest.approx(0.5 - 0.35) and cal.correlation == pytest.approx(1.0)
    assert cal.advice(cfg.reward_model) == "scale = 0.5\noffset = 0.1"
