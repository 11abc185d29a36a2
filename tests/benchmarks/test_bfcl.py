"""BFCL as a task source (lightning_middleware/benchmarks/bfcl.py): addresses and their fixed split,
BFCL's own items and tools, verdicts from BFCL's own AST checker (right answers built from its
possible answers score 1.0, changed ones 0.0), and a LangChain agent, unmodified apart from
`wrap()`, scored through a reward configuration on real rollouts against the test LLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.benchmarks import bfcl
from lightning_middleware.benchmarks.reasoning import BenchmarkError
from lightning_middleware.controller import RolloutController
from lightning_middleware.controller.tasks import load_tasks
from lightning_middleware.testing import LLMTestServer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"rules": {"bfcl": {"function": "lightning_middleware.benchmarks.bfcl:bfcl_score", "weight": 1.0}},
          "agent_reward": False}


def test_addresses_name_a_category_and_a_fixed_split() -> None:
    a = bfcl.parse("bfcl:simple_python?split=test&holdout=0.2&limit=7")
    assert (a.category, a.split, a.holdout, a.limit) == ("simple_python", "test", 0.2, 7)
    assert bfcl.parse(str(a)) == a
    train = load_tasks("bfcl:simple_python?split=train")
    test = load_tasks("bfcl:simple_python?split=test")
    every = load_tasks("bfcl:simple_python")
    assert len(every) == 400 and len(train) + len(test) == 400 and 80 <= len(test) <= 120  # holdout 0.25
    assert not {tid for tid, _ in train} & {tid for tid, _ in test}
    assert [tid for tid, _ in test] == [tid for tid, _ in load_tasks("bfcl:simple_python?split=test")]
    assert len(load_tasks("bfcl:multiple?split=test&limit=5")) == 5
    for bad, why in (("bfcl:simple", "the AST-checked ones are simple_python, multiple"),
                     ("bfcl:irrelevance", "unknown BFCL category"), ("bfcl:multiple?split=dev", "split is one of"),
                     ("bfcl:multiple?holdout=1.5", "strictly between"), ("bfcl:multiple?limt=3", "unknown keys"),
                     ("bfcl:", "bfcl:CATEGORY")):
        with pytest.raises(BenchmarkError, match=why):
            load_tasks(bad)


def test_a_question_asked_in_several_categories_is_held_out_in_all_of_them() -> None:
    """BFCL asks some questions verbatim in simple_python and in multiple (with other functions
    beside): split by id, 34 of 140 held-out items had been asked in a train part."""
    def question(t: dict) -> str:
        return t["messages"][-1]["content"]

    categories = ("simple_python", "multiple")
    train = {question(t) for c in categories for t in bfcl.tasks(f"bfcl:{c}?split=train")}
    test = [question(t) for c in categories for t in bfcl.tasks(f"bfcl:{c}?split=test")]
    everywhere = [question(t) for c in categories for t in bfcl.tasks(f"bfcl:{c}")]
    assert len(everywhere) > len(set(everywhere))  # the shared questions exist in BFCL's data
    assert test and not train & set(test)


def test_the_tasks_are_bfcls_own_items_with_its_functions_as_tools() -> None:
    (tid, task), *_ = load_tasks("bfcl:multiple?limit=1")
    item = bfcl.items("multiple")[0]
    assert tid == f"bfcl:{item['id']}" and task["messages"] == item["question"][0]
    names = [t["function"]["name"] for t in task["tools"]]
    assert names == [f["name"].replace(".", "_") for f in item["function"]]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in task["tools"])
    json.dumps(task)  # a task travels as JSON (process, sandbox and Kubernetes backends)


@pytest.mark.parametrize("category", ["simple_python", "multiple", "live_simple", "parallel"])
def test_right_answers_score_one_and_changed_ones_zero(category: str) -> None:
    checked = 0
    for (_, task), item in zip(load_tasks(f"bfcl:{category}?limit=40"), bfcl.items(category)):
        calls = bfcl.reference_calls(task)
        verdict = bfcl.check(task, calls)
        if verdict.value != 1.0:  # a possible answer this helper cannot build (nested options): say which
            pytest.fail(f"{item['id']}: {verdict.detail}")
        checked += 1
        name, args = calls[0]
        wrong_name = bfcl.check(task, [(name + "_x", args), *calls[1:]])
        assert wrong_name.value == 0.0 and wrong_name.detail["error_type"], item["id"]
        if args:
            key = sorted(args)[0]
            changed = bfcl.check(task, [(name, {**args, key: "no such value 7d1"}), *calls[1:]])
            assert changed.value == 0.0 and changed.detail["valid"] is False, item["id"]
    assert checked == 40


@pytest.mark.parametrize("category", ["simple_python", "multiple"])
def test_the_checker_stage_follows_bfcls_own_order_of_checks(category: str) -> None:
    """`bfcl_stages`' partial credit is the stage BFCL's checker reached: a wrong function 1, a
    parameter dropped or made up 2, a wrong value 3, valid 4; an answer the checker never reached 0."""
    seen: set[int] = set()
    for _, task in load_tasks(f"bfcl:{category}?limit=30"):
        (name, args), *rest = bfcl.reference_calls(task)

        def stage(calls: list[tuple[str, dict | None]], task: dict = task) -> int:
            return bfcl.checker_stage(bfcl.check(task, calls).detail["error_type"])

        assert stage([(name, args), *rest]) == 4 and stage([]) == 0 and stage([(name, None)]) == 0
        assert stage([(name + "_x", args), *rest]) == 1
        assert stage([(name, {**args, "no_such_param": 1}), *rest]) == 2
        required = [k for k in _required(task, name) if k in args]
        if required:
            assert stage([(name, {k: v for k, v in args.items() if k != required[0]}), *rest]) == 2
            assert stage([(name, {**args, required[0]: "no such value 7d1"}), *rest]) == 3
        seen.update({1, 2, 3} if required else {1, 2})
    assert seen == {1, 2, 3}
    assert bfcl.checker_stage("simple_function_checker:unclear") == 0 == bfcl.checker_stage("checker_error")


def _required(task: dict, name: str) -> list[str]:
    [tool] = [t for t in task["tools"] if t["function"]["name"] == name]
    return list(tool["function"]["parameters"].get("required", []))


def test_no_call_malformed_arguments_and_checker_failures_score_zero_and_are_counted() -> None:
    (_, task), *_ = load_tasks("bfcl:simple_python?limit=1")
    assert bfcl.check(task, []).detail["error_type"] == "no_call"
    assert bfcl.check(task, [("calculate_triangle_area", None)]).detail["error_type"] == "malformed_arguments"
    odd = bfcl.check(task, [("calculate_triangle_area", {"base": {"deep": [object()]}, "height": 5})])
    assert odd.value == 0.0 and odd.detail["valid"] is False  # the checker's verdict or its failure, never a raise
    with pytest.raises(BenchmarkError, match="not a BFCL task"):
        bfcl.check({"question": "q"}, [])


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch) -> None:
    bfcl._import_bfcl.cache_clear()
    bfcl.items.cache_clear()
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)  # as if not installed
    try:
        with pytest.raises(BenchmarkError, match=r"need bfcl-eval: pip install --no-deps"):
            load_tasks("bfcl:simple_python")
    finally:
        monkeypatch.undo()
        bfcl._import_bfcl.cache_clear()
        bfcl.items.cache_clear()


def test_a_langchain_agent_is_scored_by_bfcls_checker(llm_server: LLMTestServer, store: TraceStore) -> None:
    """The test LLM calls the first offered tool with `{"query": ...}`: LangChain parses the call,
    BFCL's checker refuses it (wrong parameters), and the rollout's reward is that 0.0 with the
    checker's error type; the calls are recorded with token IDs."""
    agent = bfcl.make_agent(llm_server.base_url, model="m", store=store)
    rewards = RewardConfig.from_dict(CONFIG)
    with RolloutController(agent, store=store, concurrency=2, rewards=rewards) as c:
        results = c.run("bfcl:simple_python?split=test&limit=3")
    assert [r.status for r in results] == ["succeeded"] * 3, [r.error for r in results]
    assert [r.reward for r in results] == [0.0] * 3
    for r in results:
        [component] = [w for w in store.rewards(r.rollout_id) if w.name == "bfcl"]
        assert component.value == 0.0 and component.metadata["detail"]["valid"] is False
        assert component.metadata["detail"]["error_type"].startswith("simple_function_checker")
        [call] = store.calls(r.rollout_id)
        assert call.completion_token_ids and call.response["choices"][0]["message"]["tool_calls"]


def test_the_stages_configuration_pays_partial_credit_and_keeps_bfcls_verdict(llm_server: LLMTestServer,
                                                                              store: TraceStore) -> None:
    """examples/rewards/bfcl-stages.toml on the same agent: the right function with parameters BFCL
    refuses earns 1/3 (stage 2), and the verdict stays invalid."""
    agent = bfcl.make_agent(llm_server.base_url, model="m", store=store)
    rewards = RewardConfig.load(ROOT / "examples" / "rewards" / "bfcl-stages.toml")
    with RolloutController(agent, store=store, concurrency=2, rewards=rewards) as c:
        results = c.run("bfcl:simple_python?split=test&limit=3")
    assert [r.status for r in results] == ["succeeded"] * 3, [r.error for r in results]
    assert [r.reward for r in results] == pytest.approx([1 / 3] * 3)
    for r in results:
        [component] = [w for w in store.rewards(r.rollout_id) if w.name == "bfcl"]
        detail = component.metadata["detail"]
        assert detail["valid"] is False and detail["stage"] == 2
        assert detail["error_type"].rsplit(":", 1)[-1] in ("missing_required", "unexpected_param")


def test_the_bfcl_agent_runs_in_the_sandbox_scored_by_the_gateway(llm_server: LLMTestServer, tmp_path) -> None:
    """The module-level agent inside a bubblewrap sandbox: OPENAI_BASE_URL is its door to the
    gateway, whose reward configuration runs BFCL's checker on the rollout as it finishes."""
    from lightning_middleware.controller import Sandbox, SandboxedBackend
    from lightning_middleware.gateway import Gateway

    store = TraceStore(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        with Gateway([llm_server.base_url], store, rewards=RewardConfig.from_dict(CONFIG), token="t0k",
                     health_interval_s=0) as gw:
            backend = SandboxedBackend(gw.url, token="t0k", sandbox=Sandbox(), workers=2,
                                       env={"LIGHTNING_MODEL": "m"})
            with RolloutController("lightning_middleware.benchmarks.bfcl:agent", store=store, backend=backend,
                                   concurrency=2, timeout_s=120) as c:
                results = c.run("bfcl:multiple?split=test&limit=2")
        assert [(r.status, r.reward) for r in results] == [("succeeded", 0.0)] * 2, [r.error for r in results]
        for r in results:
            [component] = [w for w in store.rewards(r.rollout_id) if w.name == "bfcl"]
            assert "_checker:" in component.metadata["detail"]["error_type"]  # BFCL's own verdict
            assert store.calls(r.rollout_id)[0].prompt_token_ids
    finally:
        store.close()
