"""`lightning-mw demo --task bfcl`'s own parts: its warm-start demonstrations, its evaluation by
BFCL's checker through the controller, its command line. The full run (serve, evaluate, RL) is
`bench/bench_learning.py bfcl`: a held-out gain needs hundreds of episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.benchmarks import bfcl
from lightning_middleware.controller import RolloutController
from lightning_middleware.testing import LLMTestServer
from trainer_backend.demo.smol import evaluation_pass
from trainer_backend.demo.smol_bfcl import HELD_OUT, RULES, TRAIN, UNSEEN, demonstrations, outcomes

pytest.importorskip("bfcl_eval", reason="the set-up installs bfcl-eval (scripts/setup.sh)")


def test_demonstrations_are_train_items_answered_with_calls_bfcl_accepts() -> None:
    demos = demonstrations(24, seed=3)
    assert len(demos) == 24 and demos == demonstrations(24, seed=3) and demos != demonstrations(24, seed=4)
    train = {(t["messages"][-1]["content"], json.dumps(t["tools"])): t
             for address in TRAIN for t in bfcl.tasks(address)}
    test_questions = {t["messages"][-1]["content"] for address in HELD_OUT for t in bfcl.tasks(address)}
    for messages, tools in demos:
        *question, answer = messages
        task = train[question[-1]["content"], json.dumps(tools)]  # a train item's question and tools
        assert question[-1]["content"] not in test_questions  # asked in no held-out item
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["tool_calls"]]
        assert answer["role"] == "assistant" and bfcl.check(task, calls).value == 1.0
        assert {name for name, _ in calls} <= {t["function"]["name"] for t in tools}


def test_the_evaluation_is_bfcls_verdict_at_the_tasks_temperature(llm_server: LLMTestServer, tmp_path: Path) -> None:
    """The test LLM calls the first offered tool with arguments BFCL refuses: every answer is a
    call, checkable, and wrong, each counted under the checker's own error type; the agent sends
    the evaluation's temperature."""
    store = TraceStore(f"sqlite:///{tmp_path / 'store.db'}")
    tasks = bfcl.tasks("bfcl:simple_python?split=test&limit=3") + bfcl.tasks("bfcl:multiple?split=test&limit=2")
    agent = bfcl.make_agent(llm_server.base_url, model="m", store=store, temperature=1.0)
    try:
        with RolloutController(agent, store=store, concurrency=3, rewards=RewardConfig.from_dict(RULES)) as c:
            res = evaluation_pass(c, store, tasks, temperature=0.0, tag="before-greedy", outcomes=outcomes)
            results = c.run([dict(tasks[0], task_id="extra")], mode="val")
        assert res["n"] == 5 and res["success"] == 0.0 and res["errors"] == 0
        assert res["a_call"] == 1.0 and res["valid_tool_call"] == 1.0 and res["gen_tokens"] > 0
        assert sum(res["error_types"].values()) == 5
        assert all("_checker:" in kind for kind in res["error_types"]), res["error_types"]
        evaluated = [r for r in store.query_rollouts(limit=100) if r.task_id.endswith("-before-greedy")]
        assert len(evaluated) == 5 and all(r.mode == "val" for r in evaluated)
        for r in evaluated:
            [call] = store.calls(r.id)
            assert call.request["temperature"] == 0.0  # the task's, not the agent's default of 1.0
        [extra] = results
        assert store.calls(extra.rollout_id)[0].request["temperature"] == 1.0
        assert outcomes(store, results)["n"] == 1
    finally:
        store.close()


def test_the_demos_training_rollouts_sample(llm_server: LLMTestServer, tmp_path: Path) -> None:
    """A training task carries no temperature: the demo's agent samples it at T=1 (greedy groups
    would be one answer four times, skipped by the trainer as uniform)."""
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from
    from trainer_backend.demo.smol_bfcl import BfclDemoRun

    run = BfclDemoRun(config_from(build_parser().parse_args(["demo", "--task", "bfcl", "--out", str(tmp_path)])))
    store = TraceStore(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        assert "temperature" not in run.train_tasks[0]
        with RolloutController(run._agent(llm_server.base_url, store), store=store) as c:
            [result] = c.run(run.train_tasks[:1])
        assert store.calls(result.rollout_id)[0].request["temperature"] == 1.0
    finally:
        store.close()


def test_a_rewards_file_replaces_the_binary_verdict_and_must_keep_a_bfcl_rule(tmp_path: Path, capsys) -> None:
    """`--rewards examples/rewards/bfcl-stages.toml` trains on the partial credit; a configuration
    without a `bfcl` rule (the evaluations read its verdict) is refused in one line, before anything starts."""
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from, run_cli
    from trainer_backend.demo.smol_bfcl import BfclDemoRun

    def run(rewards: Path) -> BfclDemoRun:
        args = ["demo", "--task", "bfcl", "--rewards", str(rewards), "--out", str(tmp_path / "out")]
        return BfclDemoRun(config_from(build_parser().parse_args(args)))

    stages = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "bfcl-stages.toml"
    config = run(stages).reward_config
    assert config is not None and config.hash == RewardConfig.load(stages).hash
    assert config.hash != RewardConfig.from_dict(RULES).hash
    other = tmp_path / "other.toml"
    other.write_text('[rules]\ntask_complete = 1.0\n')
    with pytest.raises(ValueError, match=r"needs a `bfcl` rule .*; it has task_complete$"):
        run(other)
    capsys.readouterr()
    assert run_cli(build_parser().parse_args(["demo", "--task", "bfcl", "--rewards", str(other)])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a `bfcl` rule" in err  # one line, before the warm start


def test_success_is_bfcls_verdict_not_the_reward(llm_server: LLMTestServer, tmp_path: Path) -> None:
    """Under partial credit an invalid answer earns a reward (here, weighted, as much as a valid one
    under the binary rule); only BFCL's verdict counts an answer as solved."""
    store = TraceStore(f"sqlite:///{tmp_path / 'store.db'}")
    paid = RewardConfig.from_dict({"rules": {"bfcl": {"function": "lightning_middleware.benchmarks.bfcl:bfcl_stages",
                                                      "weight": 3.0}}, "agent_reward": False})
    agent = bfcl.make_agent(llm_server.base_url, model="m", store=store)
    try:
        with RolloutController(agent, store=store, rewards=paid) as c:
            results = c.run("bfcl:simple_python?split=test&limit=2", mode="val")
        assert [r.reward for r in results] == pytest.approx([1.0, 1.0])  # 3 x 1/3: stage 2, refused
        res = outcomes(store, results)
        assert res["success"] == 0.0 and res["valid_tool_call"] == 1.0
    finally:
        store.close()


def test_outcomes_count_answers_without_a_call(tmp_path: Path) -> None:
    """An answer with no call is scored 0 by the rule and counted as `no_call`, not as a failure."""
    store = TraceStore(f"sqlite:///{tmp_path / 'store.db'}")
    task = bfcl.tasks("bfcl:simple_python?split=test&limit=1")[0]

    async def prose(t: dict) -> None:  # answered in words: no call to score
        return None

    try:
        with RolloutController(prose, store=store, rewards=RewardConfig.from_dict(RULES)) as c:
            results = c.run([task], mode="val")
        res = outcomes(store, results)
        assert res == {"success": 0.0, "n": 1, "a_call": 0.0, "valid_tool_call": 0.0, "errors": 0,
                       "error_types": {"no_call": 1}}
    finally:
        store.close()


def test_the_command_line_runs_smollm2_with_the_bfcl_recipe() -> None:
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import BFCL_RECIPE, config_from, run_cli

    cfg = config_from(build_parser().parse_args(["demo", "--task", "bfcl"]))
    assert (cfg.task, cfg.model_dir, cfg.out_dir) == ("bfcl", None, "runs/demo-smol-bfcl-0")
    assert (cfg.minutes, cfg.lr, cfg.eval_tasks, cfg.group_size) == (
        BFCL_RECIPE["minutes"], BFCL_RECIPE["lr"], BFCL_RECIPE["eval_tasks"], BFCL_RECIPE["group_size"])
    assert config_from(build_parser().parse_args(["demo", "--task", "bfcl", "--model", "smollm2"])).model_dir is None
    assert run_cli(build_parser().parse_args(["demo", "--task", "bfcl", "--model", "/some/folder"])) == 2
    assert len(bfcl.tasks(UNSEEN)) > 50 and UNSEEN.split("?")[0] not in {a.split("?")[0] for a in TRAIN}


# The CI run of the BFCL demo: its command line's recipe (BFCL_RECIPE) with a budget of CI_STEPS RL
# steps instead of 30 minutes, and CI_EVAL_TASKS held-out items sampled at T=1 instead of all 147
# (greedy too). What it asserts learned is the served model's preference for the trained rollouts'
# better-than-their-group answers (tests/demo/learning.py), as the arithmetic CI run does: a
# held-out gain on BFCL needs the full run (`python bench/bench_learning.py bfcl`, docs/demo.md).
CI_STEPS = 3
CI_MAX_MINUTES = 20.0
CI_EVAL_TASKS = 32
CI_MIN_Z = 2.0  # docs/demo.md, "BFCL in CI": the z measured, and what this bound leaves


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_short_bfcl_demo_learns(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("langchain")
    import os
    from dataclasses import replace

    from lightning_middleware.cli import build_parser
    from tests.demo.learning import PreferenceProbe
    from trainer_backend.demo.cli import config_from
    from trainer_backend.demo.run import run_demo
    from trainer_backend.demo.smol_bfcl import BfclDemoRun
    from trainer_backend.serving import env as serving

    if not serving.vllm_python().exists() and os.environ.get("LIGHTNING_TEST_INSTALL_VLLM") != "1":
        pytest.skip("no vLLM environment: run `lightning-mw vllm-env`")
    args = build_parser().parse_args(["demo", "--task", "bfcl", "--seed", "0", "--no-greedy",
                                      "--max-steps", str(CI_STEPS), "--minutes", str(CI_MAX_MINUTES),
                                      "--eval-tasks", str(CI_EVAL_TASKS), "--out", str(tmp_path / "bfcl")])
    probe = PreferenceProbe()
    res = run_demo(replace(config_from(args), progress=False), BfclDemoRun, after_train=probe)
    before, after, pref = res["before"]["sampled"], res["after"]["sampled"], probe.result
    assert pref is not None
    print(f"CI BFCL demo on {res['machine']['kind']}: served preference {pref.mean:+.3f} nats (z {pref.z:.1f}, "
          f"{pref.n} rollouts, moved {pref.moved:.3f}); held-out T=1 {before['success']:.1%} -> "
          f"{after['success']:.1%}, valid calls {before['valid_tool_call']:.1%} -> {after['valid_tool_call']:.1%}; "
          f"{res['steps']} steps in {res['timings']['rl_s'] / 60:.1f} min of RL")
    assert before["n"] == after["n"] == CI_EVAL_TASKS
    # the warm start taught SmolLM2 to answer with a call BFCL's checker can parse (the untouched
    # model answers most items in words): 67.3% of the 147 at T=1 (docs/demo.md), so 0.35 sits 3.9
    # standard deviations below it at 32 items; every item is scored, none crashes the run
    assert before["valid_tool_call"] >= 0.35 and before["errors"] == 0 == after["errors"], (before, after)
    assert res["steps"] == CI_STEPS, f"only {res['steps']} of {CI_STEPS} steps within {CI_MAX_MINUTES:g} min"
    # BFCL's checker is the reward: every trained rollout carries its verdict (1 or 0)
    curve = res["curve"]
    assert all(c["rollouts"] > 0 for c in curve)
    # learned: the served model moved, toward the answers BFCL's checker accepted
    assert pref.moved > 1e-3 and pref.z >= CI_MIN_Z, pref
    assert after["valid_tool_call"] >= 0.35, after  # and did not collapse
