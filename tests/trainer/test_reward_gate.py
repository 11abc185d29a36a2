"""The daemon and the rewards table: training on the reward version it is told, waiting for a
late component up to its deadline (then training without it, or skipping), the hacking rate
per step. Real rollouts on the test LLM server, real store, the real TorchEngine."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from lightning_middleware import Reward, RewardConfig, TraceStore  # noqa: E402
from lightning_middleware.rewards import Scorer, rescore  # noqa: E402
from tests.faults.matrix import wait_for  # noqa: E402
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


def _judge(body: dict) -> str:
    """Ranks try 0 and try 2 first; prose (never readable) for task a's group."""
    from tests.rewards.ranking_judge import candidates

    cands = candidates(body)
    if any("a try" in text for text in cands.values()):
        return "They all look reasonable to me."
    good = [c for c, text in cands.items() if "try 0" in text or "try 2" in text]
    return "Ranking: " + " = ".join(good) + " > " + " = ".join(c for c in cands if c not in good)


@pytest.mark.parametrize("rank_ahead", [False, True], ids=["in-the-collect", "ahead"])
def test_the_daemon_ranks_each_ready_group_before_training(llm_server, store: TraceStore, model_dir,
                                                          tmp_path, rank_ahead: bool) -> None:
    """In the collect, or in the daemon's thread ahead of it: each group asked once, a failed
    ranking (never readable) not asked again and its rollouts skipped."""
    from tests.rewards.ranking_judge import ranking_judge

    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0], "b": [0, 0, 1, 1], "c": [1, 1, 0, 0]})
    with ranking_judge(_judge) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j", "weight": 2.0, "retries": 1}})
        with pytest.raises(ValueError, match="is not the hash of rewards.config"):
            make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg, version="0" * 16))
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg, rank_ahead=rank_ahead))
        [result] = daemon.run(max_steps=1, idle_timeout_s=60)  # ahead: the first collects may find it ranking
        assert len(judge.seen) == 4  # a twice (never readable), b and c once
        if (ahead := daemon.rank_ahead) is not None:  # three more rounds of the thread: a is not asked again
            seen = ahead.rounds
            wait_for("three rounds of ranking ahead", lambda: ahead.rounds >= seen + 3, timeout=60)
        assert daemon.step_once() is None and len(judge.seen) == 4  # nothing left; nobody asked again
    m = result.metrics
    assert m["n_rollouts"] == 8  # b and c
    assert m["skipped_rank_judge_failed"] == 4  # a's rollouts: no final reward without the judge's term
    assert m["rank_judge_groups"] == 2 and m["rank_judge_failed"] == 1 and m["rank_judge_unparseable"] == 2
    for r in store.query_rollouts(task_id="b"):
        ranked = [x for x in store.rewards(r.id) if x.config_hash == cfg.hash and x.name == "rank_judge"][-1]
        agent = [x.value for x in store.rewards(r.id) if x.config_hash is None][-1]
        asked = store.calls(r.id)[0].request["messages"][0]["content"]
        assert ranked.value == pytest.approx(5 / 6 if asked in ("b try 0", "b try 2") else 1 / 6)
        assert r.final_reward == pytest.approx(agent + 2.0 * ranked.value)  # what the step trained on


def test_the_reward_config_comes_from_the_trainer_file(store: TraceStore, tmp_path) -> None:
    from trainer_backend.daemon.reward_gate import RewardGate
    from trainer_backend.daemon.settings import TrainerSettings

    rewards = tmp_path / "rewards.toml"
    rewards.write_text('[rules]\nagent_reward = 1.0\n[rank_judge]\nurl = "http://127.0.0.1:9/v1"\nmodel = "j"\n')
    trainer = tmp_path / "trainer.toml"
    trainer.write_text(f'[run]\nstore = "sqlite://"\nmodel = "m"\n[rewards]\nconfig = "{rewards}"\n')
    policy = TrainerSettings.load(trainer).trainer_config().rewards
    assert policy.config == str(rewards)
    assert RewardGate(store, policy).policy.version == RewardConfig.load(rewards).hash  # trained on its version
    rewards.write_text("[rank_judge]\nurl = 1\n")
    with pytest.raises(ValueError, match="needs the judge's url and model"):
        RewardGate(store, policy)


def test_a_config_without_a_judge_is_scored_by_the_daemon_too(llm_server, store: TraceStore, model_dir,
                                                               tmp_path) -> None:
    run_rollouts(llm_server, store, TASKS)  # the agents scored nothing under the configuration
    cfg = RewardConfig.from_dict({"rules": {"agent_reward": 3.0}})
    [result] = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg)).run(max_steps=1)
    assert result.metrics["n_rollouts"] == 8 and result.metrics["reward_max"] == 3.0
    assert not any(k.startswith("rank_judge") for k in result.metrics)
