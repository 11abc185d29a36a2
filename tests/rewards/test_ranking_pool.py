"""The ranking judge asked for several groups at once: at most `concurrency` requests in flight,
a group's ranking cut at its `deadline_s`, and neither setting in the configuration's hash.
Real rollouts in the real store, a real judge server on loopback."""

from __future__ import annotations

import time

import pytest

from lightning_middleware import RewardConfig, TraceStore, rollout
from lightning_middleware.rewards import ConfigError, rescore
from tests.rewards.helpers import client_for, tool_agent
from tests.rewards.ranking_judge import by_errors, ranking_judge, slow


def _groups(store: TraceStore, tasks: str) -> None:
    client = client_for(store)
    for task in tasks:
        for result in ("ok", "Error: boom"):
            with rollout(task, store=store, input={"question": "fix it"}):
                tool_agent(client, "fix it", result)


def test_at_most_concurrency_groups_are_asked_at_once(store: TraceStore) -> None:
    _groups(store, "abc")
    peak = [0]
    with ranking_judge(slow(by_errors, 0.5, peak)) as judge:
        cfg = RewardConfig.from_dict({"rules": {"tool_call_valid": 1.0},
                                      "rank_judge": {"url": judge.url, "model": "j", "concurrency": 2}})
        report = rescore(store, cfg)
    assert report.groups_ranked == 3 and len(judge.seen) == 3 and peak[0] == 2


def test_a_ranking_past_its_deadline_is_the_groups_error(store: TraceStore) -> None:
    _groups(store, "a")
    with ranking_judge(slow(by_errors, 3.0, [0])) as judge:
        cfg = RewardConfig.from_dict({"rules": {"tool_call_valid": 1.0}, "rank_judge": {
            "url": judge.url, "model": "j", "timeout_s": 30, "retries": 2, "deadline_s": 0.5}})
        t0 = time.perf_counter()
        report = rescore(store, cfg)
        took = time.perf_counter() - t0
    assert report.groups_failed == 1 and report.with_final == 0 and took < 6  # not 3 answers x 3 s (9 s)
    for r in store.query_rollouts():
        [errors] = [x for x in store.rewards(r.id) if x.name == "reward_errors" and x.config_hash == cfg.hash]
        assert "rank_judge.deadline_s = 0.5 s" in errors.metadata["errors"]["rank_judge"]


def test_how_many_at_once_and_how_long_are_checked_and_not_hashed() -> None:
    base = RewardConfig.from_dict({"rank_judge": {"url": "u", "model": "m"}})
    tuned = RewardConfig.from_dict({"rank_judge": {"url": "u", "model": "m", "concurrency": 8, "deadline_s": 5}})
    assert tuned.hash == base.hash and tuned.rank_judge is not None and tuned.rank_judge.deadline_s == 5.0
    for bad, why in (({"concurrency": 0}, "concurrency must be a whole number >= 1"),
                     ({"concurrency": 1.5}, "concurrency must be a whole number"),
                     ({"deadline_s": 0}, "deadline_s must be a number of seconds > 0"),
                     ({"deadline_s": "x"}, "deadline_s must be a finite number")):
        with pytest.raises(ConfigError, match=why):
            RewardConfig.from_dict({"rank_judge": {"url": "u", "model": "m", **bad}})
