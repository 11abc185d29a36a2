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
