"""`lightning-mw demo --rewards examples/rewards/hybrid-judge.toml --judge smollm2`: which judge
the demo can serve, the CLI's checks before anything starts, the wiring (the demo's own agent on
the test LLM scored under the judge configuration, its groups held for the trainer and ranked by
a real judge on loopback through the demo's reward policy), and the judge-agreement report on
crafted rankings. The measured run with SmolLM2 as the judge: docs/rewards.md, "Proof"."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_middleware import Reward, Rollout, RolloutStatus, TraceStore
from lightning_middleware.controller import RolloutController
from lightning_middleware.rewards import RewardConfig, Scorer
from lightning_middleware.testing import LLMTestServer
from tests.rewards.ranking_judge import candidates, ranking_judge
from tests.trainer import test_daemon
from tests.trainer.test_daemon import make_daemon
from trainer_backend.daemon.reward_gate import RewardGate
from trainer_backend.demo.agent import make_agent
from trainer_backend.demo.judge import JudgeConfigError, judge_address, judge_agreement, judge_line
from trainer_backend.demo.run import DemoConfig, DemoRun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "rewards"
JUDGE_TOML = EXAMPLES / "hybrid-judge.toml"


@pytest.fixture
def llm() -> Iterator[LLMTestServer]:
    with LLMTestServer() as server:  # its own: LangChain caches its async client by base URL
        yield server


def _config(tmp_path: Path, url: str) -> Path:
    """The example configuration with its judge at `url`."""
    path = tmp_path / "judge.toml"
    path.write_text(JUDGE_TOML.read_text().replace("http://127.0.0.1:8011/v1", url))
    return path


def test_the_example_names_a_local_judge_and_resolves() -> None:
    cfg = RewardConfig.load(JUDGE_TOML)
    Scorer(cfg)
    assert judge_address(cfg) == ("127.0.0.1", 8011, "judge")
    assert cfg.rank_judge is not None and cfg.rank_judge.max_tokens == 20 and cfg.on_error == "partial"
    assert cfg.weights["task_complete"] == 1.0 and cfg.weights["rank_judge"] == 0.2
    # the example that asks the judge only for the groups its one rule leaves tied, at the same judge
    uniform = RewardConfig.load(EXAMPLES / "success-judge-uniform.toml")
    Scorer(uniform)
    assert uniform.rank_judge is not None and uniform.rank_judge.scope == "uniform" and cfg.rank_judge.scope == "all"
    assert uniform.weights == {"task_complete": 1.0, "rank_judge": 0.2} and judge_address(uniform) == judge_address(cfg)


@pytest.mark.parametrize(("data", "why"), [
    (None, "give --rewards FILE"),
    ({"rules": {"task_complete": 1.0}}, "give --rewards FILE"),
    ({"rules": {"task_complete": 1.0}, "rank_judge": {"url": "https://judge.example.com/v1", "model": "j"}},
     "must be http://127.0.0.1:PORT/v1"),
    ({"rules": {"task_complete": 1.0}, "rank_judge": {"url": "http://127.0.0.1/v1", "model": "j"}},
     "must be http://127.0.0.1:PORT/v1"),
    ({"rules": {"task_complete": 1.0}, "rank_judge": {"url": "http://127.0.0.1:8011/v1", "model": "a"},
      "reward_model": {"url": "http://127.0.0.1:8012/v1", "model": "b"}}, "names 2"),
])
def test_a_judge_the_demo_cannot_serve_is_refused_with_the_reason(data: dict | None, why: str) -> None:
    with pytest.raises(JudgeConfigError, match=why.replace(".", r"\.").replace("(", r"\(")):
        judge_address(None if data is None else RewardConfig.from_dict(data))


def test_a_reward_model_judge_and_the_same_judge_twice_are_served() -> None:
    alone = RewardConfig.from_dict({"rules": {"task_complete": 1.0},
                                    "reward_model": {"url": "http://localhost:9001/v1", "model": "rm"}})
    assert judge_address(alone) == ("localhost", 9001, "rm")
    both = RewardConfig.from_dict({"rules": {"task_complete": 1.0},
                                   "reward_model": {"url": "http://127.0.0.1:8011/v1", "model": "judge"},
                                   "rank_judge": {"url": "http://127.0.0.1:8011/v1", "model": "judge"}})
    assert judge_address(both) == ("127.0.0.1", 8011, "judge")


def test_the_cli_checks_the_judge_before_anything_starts(tmp_path: Path) -> None:
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import run_cli

    out = str(tmp_path / "out")
    for argv in (["--judge", "smollm2"], ["--judge", "smollm2", "--rewards", str(EXAMPLES / "hybrid.toml")],
                 ["--judge", "smollm2", "--rewards", str(tmp_path / "missing.toml")]):
        assert run_cli(build_parser().parse_args(["demo", "--out", out, *argv])) == 2
    assert not Path(out).exists()  # refused before the warm start, the server or the store


def test_only_a_ranking_configuration_makes_the_demo_trainer_score_groups(tmp_path: Path) -> None:
    judged = DemoRun(DemoConfig(out_dir=str(tmp_path / "a"), rewards=str(JUDGE_TOML), eval_tasks=2, train_tasks=2))
    assert judged.reward_policy().config is judged.reward_config
    plain = DemoRun(DemoConfig(out_dir=str(tmp_path / "b"), rewards=str(EXAMPLES / "hybrid.toml"), eval_tasks=2,
                               train_tasks=2))
    assert plain.reward_policy().config is None  # scored as they end, as before
    assert DemoRun(DemoConfig(out_dir=str(tmp_path / "c"), eval_tasks=2, train_tasks=2)).reward_policy().config is None


def test_the_demo_agents_groups_wait_for_the_trainer_and_are_ranked_through_its_policy(
        llm: LLMTestServer, store: TraceStore, tmp_path: Path) -> None:
    def in_shown_order(body: dict) -> str:
        return "Ranking: " + " > ".join(candidates(body))

    with ranking_judge(in_shown_order) as judge:
        run = DemoRun(DemoConfig(out_dir=str(tmp_path / "out"), rewards=str(_config(tmp_path, judge.url)),
                                 eval_tasks=2, train_tasks=2))
        agent = make_agent(llm.base_url, store, max_tokens=256)
        tasks = [{"task_id": f"train-{i}", "secret": 3 + i} for i in range(2)]
        with RolloutController(agent, store=store, backend="asyncio", concurrency=8, timeout_s=60,
                               rewards=run.reward_config) as c:
            c.run(tasks, n=4)
        store.flush()
        groups = [store.query_rollouts(task_id=t["task_id"]) for t in tasks]
        assert [len(g) for g in groups] == [4, 4]
        assert all(r.final_reward is None for g in groups for r in g)  # the ranking is owed: nothing trains yet
        reviewed = RewardGate(store, run.reward_policy()).review_groups(groups)
    assert len(judge.seen) == 2  # one answer per group
    for body in judge.seen:
        assert body["model"] == "judge" and body["max_tokens"] == 20
        assert "Ranking: " in body["messages"][0]["content"]
        assert len(candidates(body)) == 4
    finals = sorted(r.final_reward for g in reviewed if g for r in g)
    # every rollout failed alike (the test LLM's call has no number): the judge's term alone
    # differs, 0.2 x (3, 2, 1, 0) / 3 over each group
    assert len(finals) == 8 and finals[-1] - finals[0] == pytest.approx(0.2)
    got = judge_agreement(store, [r.id for g in groups for r in g])
    assert got["groups"] == 2 and got["in_shown_order"] == 1.0
    assert got["pairs"] == 0 and math.isnan(got["agreement"])  # nothing solved: no pair to order


def _ranked_group(store: TraceStore, name: str, solved: list[bool], ranks: list[float]) -> list[str]:
    ids = [f"{name}-{i}" for i in range(len(solved))]
    for rid, ok, rank in zip(ids, solved, ranks):
        store.create_rollout(Rollout(id=rid, task_id=name, status=RolloutStatus.SUCCEEDED, input={"secret": 3}))
        store.add_rewards([Reward(rid, 1.0 if ok else 0.0, name="agent"),
                           Reward(rid, 0.0, name="rank_judge", config_hash="h",
                                  metadata={"source": "rank_judge", "weight": 0.2,
                                            "detail": {"candidates": ids, "rank": rank, "letter": "?"}})])
    return ids


def test_judge_agreement_counts_solved_before_unsolved_pairs(store: TraceStore) -> None:
    a = _ranked_group(store, "a", [True, False, True, False], [1, 2, 3, 4])  # shown order; 3 of 4 pairs right
    b = _ranked_group(store, "b", [False, True, False], [1.5, 1.5, 3])  # a tie (half) and one right
    c = _ranked_group(store, "c", [True, True], [2, 1])  # no unsolved member: no pair
    got = judge_agreement(store, a + b + c)
    assert got["groups"] == 3 and got["pairs"] == 4 + 2
    assert got["agreement"] == pytest.approx((3 + 0.5 + 1) / 6)
    assert got["in_shown_order"] == pytest.approx(1 / 3)
    assert judge_agreement(store, c[:1])["pairs"] == 0  # only the rollouts asked about count


model_dir = test_daemon.model_dir  # the tiny byte-level model of the daemon tests (module-scoped)


def test_the_budget_stops_new_rollout_groups_before_the_trainer_returns(
        llm: LLMTestServer, store: TraceStore, model_dir: Path, tmp_path: Path) -> None:
    """At the time cap the back-pressure thread ends and resumes the controller; a trainer still
    in its step (a judge ranking a backlog) must not leave the controller running free: in the
    judge run it started 5,000 rollouts in the ten minutes one step took."""
    from trainer_backend.demo.run import TrainingLoop

    daemon = make_daemon(store, model_dir, tmp_path)
    cfg = DemoConfig(out_dir=str(tmp_path / "out"), group_size=2, groups_per_step=1, progress=False)
    with RolloutController(make_agent(llm.base_url, store, max_tokens=64), store=store, backend="asyncio",
                           concurrency=4, timeout_s=60) as c:
        loop = TrainingLoop(cfg, c, daemon, daemon.engine)  # the trainer is never run: a step that does not return
        thread = c.start_continuous([{"task_id": f"t{i}", "secret": 3} for i in range(64)], n=2, groups_in_flight=2,
                                    on_group=loop.on_group)
        deadline = time.monotonic() + 60
        while len(loop.finished) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        loop.stop()
        c.resume()  # what the back-pressure thread does as it ends
        thread.join(timeout=30)
        assert not thread.is_alive()  # the running groups finished, no new ones started
    assert 4 <= len(store.query_rollouts(mode="train")) <= len(loop.finished) + 4


def test_the_judged_run_reports_the_judges_agreement_time_and_failures(store: TraceStore, tmp_path: Path) -> None:
    from trainer_backend.demo.judge import JudgedDemoRun

    ids = _ranked_group(store, "a", [True, False, True, False], [1, 2, 3, 4])
    run = JudgedDemoRun(DemoConfig(out_dir=str(tmp_path / "out"), rewards=str(JUDGE_TOML), eval_tasks=2,
                                   train_tasks=2))
    run.store = store
    run.out.mkdir(parents=True)
    step = {"t_s": 30.0, "success": 0.5, "finished": len(ids), "rank_judge_groups": 1.0, "rank_judge_failed": 1.0,
            "rank_judge_unparseable": 3.0, "reward_judge_s": 42.0}
    run.results.update(before={"sampled": {"success": 0.25}}, after={"sampled": {"success": 0.5}},
                       curve=[step, {**step, "t_s": 60.0}], steps=2, trained_rollouts=8)
    run.timings["rl_s"] = 60.0
    res = run.report()
    got = res["judge_summary"]
    assert got["groups"] == 1 and got["pairs"] == 4 and got["agreement"] == pytest.approx(0.75)
    assert got["in_shown_order"] == 1.0
    assert (got["rank_judge_groups"], got["rank_judge_failed"], got["reward_judge_s"]) == (2.0, 2.0, 84.0)
    assert res["gain_pp"] == pytest.approx(25.0) and (run.out / "results.json").exists()


def test_the_reports_judge_line_says_what_it_ranked_and_never_prints_nan() -> None:
    totals = {"rank_judge_groups": 77.0, "rank_judge_failed": 8.0, "rank_judge_unparseable": 17.0,
              "reward_judge_s": 60.0, "reward_judge_ahead_s": 132.0}
    agreement = {"groups": 77, "pairs": 759, "agreement": 0.469, "in_shown_order": 0.104}
    assert judge_line(totals, agreement) == (
        "judge: 77 groups ranked (8 failed, 17 unreadable answers), 3.2 min of ranking (1.0 of them waited for "
        "by the trainer); it put the solved attempt first in 46.9% of 759 (solved, unsolved) pairs (chance: 50%); "
        "10% of its rankings were the order shown")
    # scope "uniform": only tied groups are ranked, so no pair of a solved and an unsolved attempt
    tied = judge_line({**totals, "rank_judge_groups": 8.0, "rank_judge_groups_told_apart": 79.0},
                      {"groups": 8, "pairs": 0, "agreement": math.nan, "in_shown_order": 0.0})
    assert "8 groups ranked (8 failed, 17 unreadable answers; 79 told apart by the rules, not asked)" in tied
    assert tied.endswith("no ranked group had both a solved and an unsolved attempt to check it against")
    assert "nan" not in tied
