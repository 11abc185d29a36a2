"""`lightning-mw demo --rewards FILE`: the demo's reward functions on crafted trajectories, the
example configurations, and the wiring: the demo's own LangChain agent on the test LLM through a
real controller scored under a configuration, where the evaluation must report the task's own
success (not the configured reward, which pays here for a failed rollout), the tool calls per
rollout and the guards' rates. On SQLite and PostgreSQL. No long runs: the measured proof is in
docs/rewards.md."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_middleware import Reward, Rollout, RolloutStatus, TraceStore
from lightning_middleware.controller import RolloutController
from lightning_middleware.rewards import RewardConfig, Score, Scorer, Trajectory
from lightning_middleware.rewards.trajectory import build_trajectory
from lightning_middleware.testing import LLMTestServer
from tests.rewards.helpers import tool_call
from trainer_backend.demo import rewards as demo_rewards
from trainer_backend.demo.agent import evaluate, make_agent
from trainer_backend.demo.outcomes import curve_summary, report_line, step_outcomes
from trainer_backend.demo.run import DemoConfig, DemoRun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "rewards"


def _guesses(secret: int | None, guesses: list[object], reported: float | None = None) -> Trajectory:
    """A stored rollout of the guess task: its calls, and the agent's own reward if `reported`."""
    rollout = Rollout(id="r", task_id="t", status=RolloutStatus.SUCCEEDED,
                      input=None if secret is None else {"secret": secret})
    calls = [tool_call(i, "guess", {"n": g}, offered=("guess",)) for i, g in enumerate(guesses)]
    return build_trajectory(rollout, calls, [] if reported is None else [Reward("r", reported, name="agent")])


def _found(score: Score | None) -> Score:
    assert score is not None
    return score


def _final(scorer: Scorer, t: Trajectory) -> float:
    final = scorer.score(t).final
    assert final is not None
    return final


def test_demo_guards_positives_and_negatives() -> None:
    bisection = _guesses(5, [8, 4, 6, 5])  # exact bisection for 5: four guesses, all needed
    assert demo_rewards.tool_call_bonus(bisection) == 4.0
    assert _found(demo_rewards.extra_guesses(bisection)).value == 0.0
    assert _found(demo_rewards.wasted_guesses(bisection)).value == 0.0
    stalling = _guesses(8, [1, 2, 3, 8])  # 8 needs one guess; three stall, each still possible
    assert _found(demo_rewards.extra_guesses(stalling)).value == 3.0
    assert _found(demo_rewards.extra_guesses(stalling)).detail == {"guesses": 4, "needed": 1}
    assert _found(demo_rewards.wasted_guesses(stalling)).value == 0.0
    wasted = _guesses(5, [8, 8, 12, "x"])  # a repeat, one ruled out by "lower", one not a number
    assert _found(demo_rewards.wasted_guesses(wasted)).detail == {"wasted": [1, 2, 3]}
    assert demo_rewards.extra_guesses(_guesses(None, [1, 2])) is None  # no secret stored: absent
    assert demo_rewards.wasted_guesses(_guesses(None, [1, 2])) is None


@pytest.mark.parametrize("name", ["hybrid", "hackable", "hackable-guarded"])
def test_example_configurations_load_and_resolve(name: str) -> None:
    cfg = RewardConfig.load(EXAMPLES / f"{name}.toml")
    Scorer(cfg)  # every function imports
    assert cfg.weights["task_complete"] == 1.0 and len(cfg.hash) == 16


def test_hybrid_success_dominates_and_the_guarded_bonus_stops_paying_for_stalling() -> None:
    hybrid = Scorer(RewardConfig.load(EXAMPLES / "hybrid.toml"))
    worst_success = _final(hybrid, _guesses(5, [8, 8, 8, 5], reported=1.0))  # every penalty it can earn
    best_failure = _final(hybrid, _guesses(5, [8, 4, 6, 7], reported=0.0))  # well-formed calls, no secret
    assert worst_success > best_failure + 0.4
    hackable = Scorer(RewardConfig.load(EXAMPLES / "hackable.toml"))
    guarded = Scorer(RewardConfig.load(EXAMPLES / "hackable-guarded.toml"))
    honest = _guesses(8, [8], reported=1.0)
    stall = _guesses(8, [1, 2, 3, 8], reported=1.0)
    assert _final(hackable, stall) > _final(hackable, honest)  # the hack pays...
    assert _final(guarded, stall) == _final(guarded, honest)  # ... and not under the guards


@pytest.fixture
def llm() -> Iterator[LLMTestServer]:
    """A test LLM of the test's own: LangChain caches its async HTTP client by base URL, and a
    client bound to an earlier test's event loop fails with "Event loop is closed"."""
    with LLMTestServer() as server:
        yield server


def _errors(store: TraceStore) -> list[str | None]:
    return [r.error for r in store.query_rollouts(status=["failed", "timeout"])]


def _tasks(n: int) -> list[dict[str, object]]:
    return [{"task_id": f"eval-{i}", "secret": 3} for i in range(n)]


# The test LLM calls the offered tool once with {"query": ...} (no number: the game says
# "invalid"), then answers in text: the agent ends with reward 0.0 after one tool call. Paying
# 2.0 per tool call makes its configured final reward 2.0 >= 1.0, a "success" if the demo read it.
PAYS_FOR_CALLS = """
reward_type = "rule"
[rules]
task_complete = 1.0
bonus = { function = "trainer_backend.demo.rewards:tool_call_bonus", weight = 2.0 }
[guards]
wasted_guesses = { function = "trainer_backend.demo.rewards:wasted_guesses", weight = 0.0 }
"""


def test_evaluation_reports_the_tasks_own_success_under_a_paying_reward(
        llm: LLMTestServer, store: TraceStore, tmp_path: Path) -> None:
    config = tmp_path / "pays.toml"
    config.write_text(PAYS_FOR_CALLS)
    agent = make_agent(llm.base_url, store, max_tokens=256)
    with RolloutController(agent, store=store, backend="asyncio", concurrency=4, timeout_s=60,
                           rewards=str(config)) as c:
        res = evaluate(c, _tasks(4), temperature=1.0, tag="t", store=store)
        naive = evaluate(c, _tasks(4), temperature=1.0, tag="naive")  # RolloutResult.reward: the combination
        results = c.run(_tasks(3), n=2)
    assert naive["success"] == 1.0  # what reading the configured reward would claim
    assert res["errors"] == 0, _errors(store)
    assert res["success"] == 0.0 and res["n"] == 4
    assert res["by_secret"] == {3: 0.0} and naive["by_secret"] == {3: 1.0}  # each secret's share won
    assert res["tool_calls_mean"] == 1.0
    assert res["hacking_rate"] == 1.0 and res["guard_wasted_guesses_rate"] == 1.0  # a call without a number
    assert all(r.reward == 2.0 for r in results)  # the trainer's reward is the combination
    step = step_outcomes(store, results)
    assert step == {"success": 0.0, "tool_calls_mean": 1.0, "hacking_rate": 1.0, "guard_wasted_guesses_rate": 1.0}
    assert step_outcomes(None, results) == {"success": 1.0}  # no store: the results' rewards alone


def test_evaluation_without_a_configuration_reads_the_agents_reward(
        llm: LLMTestServer, store: TraceStore) -> None:
    agent = make_agent(llm.base_url, store, max_tokens=256)
    with RolloutController(agent, store=store, backend="asyncio", concurrency=4, timeout_s=60) as c:
        res = evaluate(c, _tasks(2), temperature=1.0, tag="t", store=store)
        greedy = evaluate(c, _tasks(2), temperature=0.0, tag="g", store=store)
    assert res["errors"] == 0, _errors(store)
    assert res["success"] == 0.0 and res["tool_calls_mean"] == 1.0 and "hacking_rate" not in res
    assert "secrets" not in res and greedy["secrets"] == {"won": [], "lost": [3], "mixed": []}  # greedy's headline


def test_the_run_records_the_configuration_and_its_hash(tmp_path: Path) -> None:
    path = EXAMPLES / "hackable-guarded.toml"
    run = DemoRun(DemoConfig(out_dir=str(tmp_path / "out"), rewards=str(path), eval_tasks=2, train_tasks=2))
    cfg = RewardConfig.load(path)
    saved = json.loads(json.dumps(run.results["rewards"], default=str))
    assert saved["hash"] == cfg.hash and saved["path"] == str(path)
    assert [c["name"] for c in saved["config"]["components"]] == [c.name for c in cfg.components]
    bad = tmp_path / "bad.toml"
    bad.write_text("[rules]\nnot_a_rule = 1.0\n")
    with pytest.raises(ValueError, match="no built-in rule 'not_a_rule'"):
        DemoRun(DemoConfig(out_dir=str(tmp_path / "out2"), rewards=str(bad)))


def test_cli_takes_rewards_for_the_guess_task_only(tmp_path: Path) -> None:
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from, run_cli

    args = build_parser().parse_args(["demo", "--rewards", "r.toml", "--max-steps", "5"])
    assert config_from(args).rewards == "r.toml"
    assert config_from(build_parser().parse_args(["demo"])).rewards is None
    assert run_cli(build_parser().parse_args(["demo", "--task", "team", "--rewards", "r.toml"])) == 2


def test_curve_summary_weighs_steps_by_their_rollouts_and_report_line() -> None:
    curve = [{"success": 0.2, "tool_calls_mean": 3.0, "hacking_rate": 0.5, "finished": 30, "batch_hacking_rate": 0.4},
             {"success": float("nan"), "finished": 0},  # no rollout finished: left out
             {"success": 1.0, "tool_calls_mean": 1.0, "hacking_rate": 0.0, "finished": 10, "batch_hacking_rate": 0.2}]
    got = curve_summary(curve, last=0.34)
    assert got["all_steps"]["success"] == pytest.approx(0.4)  # (30 x 0.2 + 10 x 1.0) / 40, not 0.6
    assert got["all_steps"]["tool_calls_mean"] == pytest.approx(2.5)
    assert got["all_steps"]["batch_hacking_rate"] == pytest.approx(0.3)  # the trained batch: by step
    assert got["last_steps"] == {"success": 1.0, "tool_calls_mean": 1.0, "hacking_rate": 0.0, "batch_hacking_rate": 0.2}
    res = {"before": {"sampled": {"tool_calls_mean": 3.25}}, "after": {"sampled": {"tool_calls_mean": 3.9}},
           "rl_summary": {"last_steps": {"hacking_rate": 0.9}}, "rewards": {"hash": "abcd"}}
    assert report_line(res) == ("tool calls per held-out rollout: 3.25 -> 3.90; hacking rate of the train "
                                "rollouts (last quarter of RL): 90.0%; reward configuration abcd")
    assert report_line({"before": {"sampled": {"success": 0.4}}, "after": {"sampled": {"success": 0.6}}}) == ""
    res["rl_summary"] = {"last_steps": {"hacking_rate": float("nan")}}  # no train rollout finished at the end
    assert "hacking rate" not in report_line(res)
