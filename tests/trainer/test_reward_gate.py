"""The daemon and the rewards table: training on the reward version it is told, waiting for a
late component up to its deadline (then training without it, or skipping), the hacking rate
per step. Real rollouts on the test LLM server, real store, the real TorchEngine."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from lightning_middleware import Reward, RewardConfig, TraceStore  # noqa: E402
from lightning_middleware.rewards import Scorer, rescore  # noqa: E402
from tests.trainer import test_daemon  # noqa: E402
from tests.trainer.test_daemon import make_daemon, run_rollouts  # noqa: E402
from trainer_backend.daemon.reward_gate import RewardPolicy  # noqa: E402

model_dir = test_daemon.model_dir  # the same tiny byte-level model (a module-scoped fixture)

TASKS = {"a": [1, 0, 1, 0], "b": [0, 0, 1, 1]}


def _claims_success(t) -> float:
    return float(t.reported_reward == 1.0)


def test_trains_on_the_reward_version_it_is_told(llm_server, store: TraceStore, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, TASKS)
    doubled = RewardConfig.from_dict({"rules": {"agent_reward": 2.0}})
    ids = [r.id for r in store.query_rollouts()]
    report = rescore(store, doubled, rollout_ids=ids[1:], apply="none")  # a new version, beside final_reward
    assert report.rollouts == 7 and report.applied == 0
    assert {r.final_reward for r in store.query_rollouts()} == {0.0, 1.0}  # untouched
    daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(version=doubled.hash))
    [result] = daemon.run(max_steps=1)
    m = result.metrics
    assert m["n_rollouts"] == 7 and m["skipped_no_reward_version"] == 1
    assert m["reward_max"] == 2.0 and m["reward_min"] == 0.0  # the version's values, not final_reward's


def test_waits_for_a_late_component_then_uses_it(llm_server, store: TraceStore, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, TASKS)
    cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "human": {"weight": 10.0},
                                  "guards": {"claims": {"function": _claims_success, "weight": 0.0}}})
    rescore(store, cfg)
    daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(wait_for={"human": 3600}))
    assert daemon.step_once() is None and store.query_rollouts(claimed=True) == []  # waiting, nothing held
    scorer = Scorer(cfg)
    for i, r in enumerate(store.query_rollouts()):  # the labels arrive late (e.g. the review page)
        store.add_reward(Reward(r.id, float(i % 2), name="human", final=False))
        scorer.score_rollout(store, r.id, reuse_model=True)
    result = daemon.step_once()
    assert result is not None
    m = result.metrics
    assert m["n_rollouts"] == 8 and m["reward_max"] > 10  # the human component is in the trained reward
    assert m["rewards_waiting"] == 0 and not any(k.startswith("rewards_trained_without") for k in m)
    assert m["hacking_rate"] == 0.5 and m["guard_claims_rate"] == 0.5  # half the rollouts report success


@pytest.mark.parametrize("on_deadline", ["train_without", "skip"])
def test_after_the_deadline_trains_without_or_skips(llm_server, store: TraceStore, model_dir, tmp_path,
                                                    on_deadline: str) -> None:
    run_rollouts(llm_server, store, {**TASKS, "c": [1, 0, 0, 1]})
    cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "human": {"weight": 10.0}})
    rescore(store, cfg)
    labelled = store.query_rollouts(task_id="c")
    for i, r in enumerate(labelled):
        store.add_reward(Reward(r.id, float(i % 2), name="human", final=False))
        Scorer(cfg).score_rollout(store, r.id, reuse_model=True)
    daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(wait_for={"human": 0.0},
                                                                       on_deadline=on_deadline))
    if on_deadline == "skip":
        # a and b are past the deadline without labels: skipped, counted; c alone is one group of two wanted
        assert daemon.step_once() is None
        assert daemon.skipped_total["late_human"] == 8
        assert {r.task_id for r in store.query_rollouts(consumed=True)} == {"a", "b"}
        return
    result = daemon.step_once()
    assert result is not None
    # a and b, the first groups ready, are taken without their labels; c (labelled) is left for the next step
    assert result.metrics["rewards_trained_without_human"] == 8 and result.metrics["n_rollouts"] == 8
