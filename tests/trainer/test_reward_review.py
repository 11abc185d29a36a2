"""The daemon's reward review beyond versions and deadlines (test_reward_gate.py): a ranking that
only a trainer with the configuration can do (held loudly, not skipped), ready groups ranked
concurrently with the judge's time as a step metric, ranked ahead in a thread while the trainer
trains (each group once), and a per-call component awaited for every call. Real rollouts on the
test LLM server, a real judge on loopback, the real store and TorchEngine."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import openai
import pytest

pytest.importorskip("torch")

from lightning_middleware import Reward, RewardConfig, TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.rewards import rescore  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402
from tests.faults.matrix import wait_for  # noqa: E402
from tests.rewards.ranking_judge import Judge, candidates, ranking_judge, slow  # noqa: E402
from tests.trainer import test_daemon  # noqa: E402
from tests.trainer.test_daemon import make_daemon, run_rollouts  # noqa: E402
from trainer_backend.daemon.config import GroupPolicy  # noqa: E402
from trainer_backend.daemon.reward_gate import RewardGate, RewardPolicy  # noqa: E402

model_dir = test_daemon.model_dir  # the same tiny byte-level model (a module-scoped fixture)

TASKS: dict[str, list[float]] = {"a": [1, 0, 1, 0], "b": [0, 0, 1, 1]}


def _in_order(body: dict[str, Any]) -> str:
    return "Ranking: " + " > ".join(candidates(body))


def _scored_as_they_end(server: LLMTestServer, store: TraceStore, cfg: RewardConfig) -> None:
    """Two-turn rollouts scored under `cfg` as they end (what wrap()'s or the gateway's config does)."""
    client = wrap(openai.OpenAI(base_url=server.base_url, api_key="x"), store=store)
    for task, rewards in TASKS.items():
        for i, reward in enumerate(rewards):
            with rollout(task, store=store, rewards=cfg) as r:
                out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{task} {i}"}],
                                                     max_tokens=12)
                client.chat.completions.create(model="m", max_tokens=12, messages=[
                    {"role": "user", "content": f"{task} {i}"},
                    {"role": "assistant", "content": out.choices[0].message.content},
                    {"role": "user", "content": "again"}])
                r.reward(reward)


def test_a_ranking_the_trainer_cannot_do_is_held_loudly_until_it_is_done(llm_server, store: TraceStore, model_dir,
                                                                        tmp_path, caplog) -> None:
    with ranking_judge(_in_order) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j"}})
        _scored_as_they_end(llm_server, store, cfg)
        for r in store.query_rollouts():  # the ranking is pending, and the rollout says so
            assert r.final_reward is None
            [marker] = [x for x in store.rewards(r.id) if x.name == "reward_pending"]
            assert marker.config_hash == cfg.hash and marker.metadata["pending"] == ["rank_judge"]
        daemon = make_daemon(store, model_dir, tmp_path)  # started without --reward-config
        with caplog.at_level(logging.WARNING, logger="trainer_backend.daemon.reward_gate"):
            assert daemon.step_once() is None and daemon.step_once() is None
        # held: not skipped as no_reward (that would consume them for good), nothing claimed
        assert not daemon.skipped_total and store.query_rollouts(consumed=True) == []
        assert store.query_rollouts(claimed=True) == []
        [warning] = [x.getMessage() for x in caplog.records if "reward configuration" in x.getMessage()]
        assert "8 rollouts" in warning and cfg.hash in warning and "rank_judge" in warning
        assert "--reward-config FILE" in warning and "lightning-mw rewards rescore" in warning
        [event] = store.events(kind="rewards_pending")
        assert event.source == "trainer-0"
        assert event.data == {"config_hash": cfg.hash, "pending": ["rank_judge"], "rollouts": 8}
        # told to train on that version, but without the configuration: held the same way
        groups = [store.query_rollouts(task_id=t) for t in TASKS]
        assert RewardGate(store, RewardPolicy(version=cfg.hash)).review_groups(groups) == [None, None]
        assert judge.seen == []
        report = rescore(store, cfg)  # the fix the warning names (or a restart with --reward-config)
        assert report.groups_ranked == 2 and len(judge.seen) == 2
    result = daemon.step_once()
    assert result is not None
    m = result.metrics
    assert m["n_rollouts"] == 8 and m["rewards_pending_rank_judge"] == 0.0  # recovered: none held any more
    assert len(store.events(kind="rewards_pending", source="trainer-0")) == 1  # the daemon reported it once


def test_ready_groups_are_ranked_concurrently_and_the_judge_time_is_a_metric(llm_server, store: TraceStore,
                                                                              model_dir, tmp_path) -> None:
    latency, peak = 2.0, [0]
    run_rollouts(llm_server, store, {t: [1, 0, 1, 0] for t in "abcd"})
    with ranking_judge(slow(_in_order, latency, peak)) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j", "concurrency": 4}})
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg, rank_ahead=False),
                             group=GroupPolicy(group_size=4, groups_per_step=4, min_group_size=2))
        t0 = time.perf_counter()
        batch = daemon.collect()
        collect_s = time.perf_counter() - t0
        assert batch is not None and len(judge.seen) == 4 and peak[0] == 4  # all four groups asked at once
    result = daemon.train(batch)
    assert result is not None
    m = result.metrics
    assert m["rank_judge_groups"] == 4 and m["n_rollouts"] == 16
    # about one judge latency, not the sum of four (8 s)
    assert latency <= m["reward_judge_s"] < 2 * latency and collect_s < 2 * latency + 1.0
    print(f"4 groups, judge latency {latency} s: reward_judge_s {m['reward_judge_s']:.2f}, collect {collect_s:.2f} s")


def test_with_scope_uniform_the_judge_ranks_only_the_groups_the_rules_leave_without_signal(
        llm_server, store: TraceStore, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, {**TASKS, "c": [1, 1, 1, 1]})
    with ranking_judge(_in_order) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "rank_judge": {
            "url": judge.url, "model": "j", "weight": 0.5, "scope": "uniform"}})
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg, rank_ahead=False),
                             group=GroupPolicy(group_size=4, groups_per_step=3, min_group_size=2))
        result = daemon.step_once()
        [body] = judge.seen  # group c alone: a and b have signal from their rules
        assert len(candidates(body)) == 4
    assert result is not None
    m = result.metrics
    # c's ranking gave it signal: it trains beside a and b, instead of being skipped as uniform
    assert m["n_groups"] == 3 and m["n_rollouts"] == 12 and "skipped_uniform_reward" not in m
    assert m["rank_judge_groups"] == 1 and m["rank_judge_groups_told_apart"] == 2
    assert {r.final_reward for r in store.query_rollouts(task_id="a")} == {0.0, 1.0}  # the rules alone
    assert len({r.final_reward for r in store.query_rollouts(task_id="c")}) == 4


def test_a_backlog_of_ready_groups_is_ranked_a_chunk_at_a_time(llm_server, store: TraceStore, model_dir,
                                                                 tmp_path) -> None:
    """Six ready groups, a step of one, a judge of concurrency 2: a collect reviews the oldest
    two groups and asks the judge only about those without a ranking; the rest wait in the pool
    unranked until a step gets to them (before, every ready group was ranked in the first collect)."""
    run_rollouts(llm_server, store, {t: [1, 0, 1, 0] for t in "abcdef"})

    def ranked_tasks() -> set[str]:
        stored = store.rewards_for([r.id for r in store.query_rollouts()])
        return {store.get_rollout(rid).task_id for rid, rs in stored.items() if any(x.name == "rank_judge" for x in rs)}

    with ranking_judge(_in_order) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j", "concurrency": 2}})
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg, rank_ahead=False),
                             group=GroupPolicy(group_size=4, groups_per_step=1, min_group_size=2))
        steps = []
        for asked, ranked in ((2, "ab"), (3, "abc"), (4, "abcd")):
            result = daemon.step_once()
            assert result is not None and result.metrics["n_groups"] == 1
            assert len(judge.seen) == asked and ranked_tasks() == set(ranked)
            steps.append(result.metrics["rank_judge_groups"])
    assert steps == [2, 1, 1]
    assert sorted({r.task_id for r in store.query_rollouts(consumed=True)}) == ["a", "b", "c"]


def _asked(judge: Judge) -> list[str]:
    """The task of each group the judge was asked to rank (its transcripts say "<task> try <i>")."""
    found = (re.search(r"\b(\w) try \d", text) for body in judge.seen for text in list(candidates(body).values())[:1])
    return sorted(m.group(1) for m in found if m)


def _ranked_tasks(store: TraceStore) -> set[str]:
    stored = store.rewards_for([r.id for r in store.query_rollouts()])
    by_task: dict[str, list[bool]] = {}
    for r in store.query_rollouts():
        by_task.setdefault(r.task_id, []).append(any(x.name == "rank_judge" for x in stored.get(r.id, [])))
    return {t for t, ranked in by_task.items() if all(ranked)}


def test_ranking_ahead_takes_the_judge_off_the_step(llm_server, store: TraceStore, model_dir, tmp_path) -> None:
    """Four ready groups, steps of two: the daemon's thread ranks the next two steps' groups while
    nothing trains, so the steps' collects wait for no judge (reward_judge_s 0) and each group is
    asked about once."""
    latency, peak = 1.0, [0]
    run_rollouts(llm_server, store, {t: [1, 0, 1, 0] for t in "abcd"})
    with ranking_judge(slow(_in_order, latency, peak)) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j", "concurrency": 4}})
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg))
        wait_for("the thread to rank four groups", lambda: _ranked_tasks(store) == set("abcd"))
        first, second = daemon.step_once(), daemon.step_once()
    assert first is not None and second is not None
    assert _asked(judge) == ["a", "b", "c", "d"] and peak[0] == 4  # once each, all four at once
    m1, m2 = first.metrics, second.metrics
    assert m1["reward_judge_s"] == 0.0 and m2["reward_judge_s"] == 0.0  # no collect asked the judge
    assert m1["rank_judge_ahead_groups"] == 4 and m1["reward_judge_ahead_s"] >= latency
    assert m2["rank_judge_ahead_groups"] == 0 and m2["reward_judge_ahead_s"] == 0.0
    assert m1["rank_judge_groups"] == 4 and m1["n_groups"] == m2["n_groups"] == 2
    assert sorted({r.task_id for r in store.query_rollouts(consumed=True)}) == ["a", "b", "c", "d"]


def test_a_group_the_thread_is_ranking_waits_unclaimed_and_is_ranked_once(llm_server, store: TraceStore,
                                                                          model_dir, tmp_path) -> None:
    """A collect that meets groups whose ranking is under way in the thread leaves them in the
    pool (no claim, no second request to the judge); the next collect trains them."""
    latency = 3.0
    run_rollouts(llm_server, store, {t: [1, 0, 1, 0] for t in "ab"})
    with ranking_judge(slow(_in_order, latency, [0])) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j", "concurrency": 2}})
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg))
        wait_for("the thread to ask the judge", lambda: len(judge.seen) >= 1)
        assert daemon.collect() is None  # both groups are being ranked: they wait
        assert store.query_rollouts(claimed=True) == [] and not daemon.skipped_total
        [result] = daemon.run(max_steps=1, idle_timeout_s=60)
    assert _asked(judge) == ["a", "b"]
    assert result.metrics["n_groups"] == 2 and result.metrics["reward_judge_s"] == 0.0


def test_at_scope_uniform_a_tied_group_waits_for_the_thread_while_the_groups_told_apart_train(
        llm_server, store: TraceStore, model_dir, tmp_path) -> None:
    """A judge that ranks only tied groups, ranking ahead: the oldest group (c) is tied and under
    ranking, and the collect does not wait for it: the two groups the rules tell apart train at
    once; c trains at the next step, ranked once. (Before, the thread held every group it had
    taken, tied or not, for the judge's whole latency, and the collect waited.)"""
    latency = 3.0
    run_rollouts(llm_server, store, {"c": [1, 1, 1, 1], "a": [1, 0, 1, 0], "b": [0, 0, 1, 1], "d": [1, 0, 0, 0]})
    with ranking_judge(slow(_in_order, latency, [0])) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "rank_judge": {
            "url": judge.url, "model": "j", "weight": 0.5, "concurrency": 2, "scope": "uniform"}})
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg),
                             group=GroupPolicy(group_size=4, groups_per_step=2, min_group_size=2))
        wait_for("the thread to ask the judge about c", lambda: len(judge.seen) >= 1)
        t0 = time.perf_counter()
        batch = daemon.collect()
        collect_s = time.perf_counter() - t0
        assert batch is not None and {r.task_id for r in batch.rollouts} == {"a", "b"}
        assert collect_s < latency / 2  # no judge latency on the step's path
        first = daemon.train(batch)
        [second] = daemon.run(max_steps=1, idle_timeout_s=60)
    assert first is not None
    assert _asked(judge) == ["c"]  # the tied group alone, once
    assert sorted({r.task_id for r in store.query_rollouts(consumed=True)}) == ["a", "b", "c", "d"]
    assert second.metrics["n_groups"] == 2 and second.metrics["n_rollouts"] == 8
    assert first.metrics["reward_judge_s"] < latency and second.metrics["reward_judge_s"] < latency
    ranked = [m.metrics[f"rank_judge_{k}"] for m in (first, second) for k in ("groups", "groups_told_apart")]
    assert sum(ranked[0::2]) == 1 and sum(ranked[1::2]) == 3
    assert len({r.final_reward for r in store.query_rollouts(task_id="c")}) == 4  # the judge broke the tie


def test_a_group_too_stale_to_train_is_skipped_before_any_judge_sees_it(llm_server, store: TraceStore, model_dir,
                                                                        tmp_path) -> None:
    """The oldest group (o) lags five versions, past max_staleness: neither the rank-ahead thread nor
    a collect ranks it (before, the judge ranked it and the collect then skipped it as stale)."""
    run_rollouts(llm_server, store, {"o": [1, 1, 1, 1]}, policy_version=0)
    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0], "b": [0, 0, 1, 1], "c": [0, 0, 0, 0]}, policy_version=5)
    with ranking_judge(_in_order) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "rank_judge": {
            "url": judge.url, "model": "j", "weight": 0.5, "concurrency": 2, "scope": "uniform"}})
        daemon = make_daemon(store, model_dir, tmp_path, rewards=RewardPolicy(config=cfg), mode="async",
                             max_staleness=2, policy_version=5,
                             group=GroupPolicy(group_size=4, groups_per_step=3, min_group_size=2))
        [result] = daemon.run(max_steps=1, idle_timeout_s=60)
    assert _asked(judge) == ["c"]  # the fresh tied group only
    assert result.metrics["skipped_stale"] == 4 and result.metrics["n_groups"] == 3
    assert {r.task_id for r in store.query_rollouts(consumed=True) if r.consumed_step == -1} == {"o"}


def test_at_scope_uniform_the_thread_ranks_tied_groups_on_demand_newest_first(llm_server, store: TraceStore) -> None:
    """A tied group trains only once ranked and only while fresh. The thread scores every group the
    rules tell apart (no judge call), asks the judge only while fewer than `limit` groups with signal
    wait, and then ranks the newest tied groups first: the oldest (x) is the one nearest to going
    stale. (Before, it ranked the oldest first, and beyond what the trainer took.)"""
    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0], "x": [1, 1, 1, 1], "y": [0, 0, 0, 0], "z": [1, 1, 1, 1]})
    with ranking_judge(_in_order) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "rank_judge": {
            "url": judge.url, "model": "j", "weight": 0.5, "scope": "uniform", "concurrency": 2}})
        gate = RewardGate(store, RewardPolicy(config=cfg))
        pool = [store.query_rollouts(task_id=t) for t in "axyz"]  # oldest first, as the daemon's pool
        assert gate.rank_ahead(pool, limit=1) == 1 and judge.seen == []  # a: enough signal for a step
        [a] = gate.review_groups(pool[:1], defer_ranking=True)
        assert a is not None and sorted(r.final_reward for r in a) == [0.0, 0.0, 1.0, 1.0]
        assert gate.rank_ahead(pool, limit=3) == 2 and _asked(judge) == ["y", "z"]  # two short: the newest two
        assert gate.rank_ahead(pool, limit=3) == 0 and len(judge.seen) == 2  # three groups with signal wait
        assert gate.rank_ahead(pool) == 1 and _asked(judge) == ["x", "y", "z"]  # no limit: every tied group
        reviewed = gate.review_groups(pool, defer_ranking=True)
    assert all(g is not None and len({r.final_reward for r in g}) > 1 for g in reviewed)


def test_where_nothing_goes_stale_the_thread_ranks_the_oldest_tied_group_first(llm_server, store: TraceStore) -> None:
    """`newest_first=False` (the daemon keeps stale rollouts, or cannot tell their lag): no group
    goes stale, so the oldest tied group is ranked first and none waits for ever behind newer ones."""
    run_rollouts(llm_server, store, {"x": [1, 1, 1, 1], "y": [0, 0, 0, 0], "z": [1, 1, 1, 1]})
    with ranking_judge(_in_order) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "rank_judge": {
            "url": judge.url, "model": "j", "weight": 0.5, "scope": "uniform"}})
        gate = RewardGate(store, RewardPolicy(config=cfg))
        pool = [store.query_rollouts(task_id=t) for t in "xyz"]
        assert gate.rank_ahead(pool, limit=1, newest_first=False) == 1 and _asked(judge) == ["x"]
        assert gate.rank_ahead(pool, limit=1, newest_first=False) == 0 and len(judge.seen) == 1
        assert gate.rank_ahead(pool, limit=2) == 1 and _asked(judge) == ["x", "z"]


def test_a_failed_ranking_is_not_asked_again(llm_server, store: TraceStore) -> None:
    """A judge never readable: the gate's ranking fails once (its retry included) and the group
    counts as ranked: the thread does not ask again each round, and the collect skips its rollouts."""
    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0]})
    with ranking_judge(["I cannot rank these."]) as judge:
        cfg = RewardConfig.from_dict({"rules": {"agent_reward": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j", "retries": 1}})
        gate = RewardGate(store, RewardPolicy(config=cfg))
        group = store.query_rollouts(task_id="a")
        assert gate.rank_ahead([group]) == 1 and len(judge.seen) == 2
        assert gate.rank_ahead([group]) == 0 and len(judge.seen) == 2
        [reviewed] = gate.review_groups([group])
    assert reviewed is not None and all(r.final_reward is None for r in reviewed)
    assert {gate.reasons[r.id] for r in group} == {"rank_judge_failed"} and len(judge.seen) == 2


def test_a_per_call_component_is_awaited_for_every_call(llm_server, store: TraceStore, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, TASKS)
    rollouts = store.query_rollouts()
    calls = store.calls_for([r.id for r in rollouts], training_only=True)
    assert all(sorted({c.call_index for c in calls[r.id]}) == [0, 1] for r in rollouts)
    daemon = make_daemon(store, model_dir, tmp_path, credit="per-turn",
                         rewards=RewardPolicy(wait_for={"step_judge": 3600}))
    for r in rollouts:  # a per-step judge's verdicts arrive late, the first call's first
        store.add_reward(Reward(r.id, 0.5, name="step_judge", final=False, call_index=0))
    assert daemon.step_once() is None and store.query_rollouts(claimed=True) == []  # call 1 is still to come
    for i, r in enumerate(rollouts):
        store.add_reward(Reward(r.id, float(i % 3), name="step_judge", final=False, call_index=1))
    result = daemon.step_once()
    assert result is not None
    m = result.metrics
    assert m["n_rollouts"] == 8 and m["rewards_waiting"] == 0 and m["step_rewards_used"] == 16
    assert not any(k.startswith("rewards_trained_without") for k in m)


def test_a_per_call_component_past_its_deadline_trains_without_the_rest(llm_server, store: TraceStore, model_dir,
                                                                        tmp_path) -> None:
    run_rollouts(llm_server, store, TASKS)
    for r in store.query_rollouts():  # only the first call was judged
        store.add_reward(Reward(r.id, 0.5, name="step_judge", final=False, call_index=0))
    daemon = make_daemon(store, model_dir, tmp_path, credit="per-turn",
                         rewards=RewardPolicy(wait_for={"step_judge": 0.0}))
    result = daemon.step_once()
    assert result is not None
    assert result.metrics["rewards_trained_without_step_judge"] == 8 and result.metrics["step_rewards_used"] == 8


def test_a_per_call_component_of_one_agent_waits_for_that_agents_calls(llm_server, store: TraceStore) -> None:
    from lightning_middleware import agent_scope

    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store)
    for i in range(2):
        with rollout("review", store=store) as r:
            for agent in ("coder", "reviewer", "reviewer"):  # calls 0, 1, 2
                with agent_scope(agent):
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": agent}],
                                                   max_tokens=8)
            r.reward(float(i))
    group = store.query_rollouts(task_id="review")
    by_agent = RewardGate(store, RewardPolicy(wait_for={"review_judge": 3600}))
    every_turn = RewardGate(store, RewardPolicy(wait_for={"turn_judge": 3600}))
    for r in group:  # the reviewer's judge scored the reviewer's first call; a judge of every turn, call 2
        store.add_reward(Reward(r.id, 1.0, name="review_judge", final=False, call_index=1, agent="reviewer"))
        store.add_reward(Reward(r.id, 1.0, name="turn_judge", final=False, call_index=2))
    assert by_agent.review_groups([group]) == [None] and every_turn.review_groups([group]) == [None]
    for r in group:  # the reviewer's last call: review_judge is in (the coder's call is none of its business)
        store.add_reward(Reward(r.id, 1.0, name="review_judge", final=False, call_index=2, agent="reviewer"))
    [reviewed] = by_agent.review_groups([group])
    assert reviewed is not None and len(reviewed) == 2
    assert by_agent.step_metrics(reviewed)["rewards_waiting"] == 0
    assert every_turn.review_groups([group]) == [None]  # turn_judge still lacks calls 0 and 1
    for r in group:
        for k in (0, 1):
            store.add_reward(Reward(r.id, 0.5, name="turn_judge", final=False, call_index=k))
    [reviewed] = every_turn.review_groups([group])
    assert reviewed is not None and every_turn.step_metrics(reviewed)["rewards_waiting"] == 0
