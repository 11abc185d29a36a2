"""Reward configurations, rules, guards, the reward model and their combination, through real
rollouts on the test LLM and a real judge server; store-touching tests run on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_middleware import Reward, RewardConfig, Rollout, RolloutStatus, Score, TraceStore, rollout
from lightning_middleware.records import TrainStep
from lightning_middleware.rewards import ConfigError, Scorer, guards, load_trajectory
from lightning_middleware.rewards.config import tomllib
from lightning_middleware.rewards.trajectory import build_trajectory
from tests.rewards.helpers import client_for, judge_server, tool_agent, tool_call

SEEDS_TOML = """
reward_type = "hybrid"
on_error = "partial"
[rules]
tool_call_valid = 1.0
task_complete = 5.0
syntax_error = -2.0
[guards]
repeated_tool_calls = { weight = -1.0, max_repeats = 1 }
[reward_model]
weight = 2.0
url = "JUDGE"
model = "judge"
[human]
weight = 3.0
interval = 10
"""


def _by_name(store: TraceStore, rid: str, config_hash: str) -> dict[str, Reward]:
    return {r.name: r for r in store.rewards(rid) if r.config_hash == config_hash}


def test_the_seeds_configuration_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "rewards.toml"
    path.write_text(SEEDS_TOML.replace("JUDGE", "http://127.0.0.1:9/v1"))
    cfg = RewardConfig.load(path)
    assert cfg.weights == {"tool_call_valid": 1.0, "task_complete": 5.0, "syntax_error": -2.0,
                           "repeated_tool_calls": -1.0, "reward_model": 2.0, "human": 3.0}
    assert [c.kind for c in cfg.components] == ["rule", "rule", "rule", "guard"]
    assert cfg.guards[0].params == {"max_repeats": 1}
    # The hash names what changes a reward: stable across loads, the JSON form, a new weight moves it.
    json_path = tmp_path / "rewards.json"
    json_path.write_text(json.dumps(_toml_as_dict(path)))
    assert RewardConfig.load(json_path).hash == cfg.hash == RewardConfig.load(path).hash
    assert RewardConfig.load(path).hash != RewardConfig.from_dict(
        {**_toml_as_dict(path), "rules": {"tool_call_valid": 1.0, "task_complete": 4.0, "syntax_error": -2.0}}).hash


def _toml_as_dict(path: Path) -> dict:
    return tomllib.loads(path.read_text())


@pytest.mark.parametrize(("data", "message"), [
    ({"rules": {"tool_call_valid": "high"}}, "rules.tool_call_valid must be a finite number"),
    ({"rules": {"no_such_rule": 1.0}}, "no built-in rule 'no_such_rule'"),
    ({"rules": {"x": {"function": "nosuchpkg.mod:fn", "weight": 1.0}}}, "cannot be imported"),
    ({"reward_type": "model", "rules": {"succeeded": 1.0}}, "reward_type 'model' takes no [rules]"),
    ({"reward_type": "model"}, "needs a [reward_model]"),
    ({"reward_type": "rule", "rules": {"succeeded": 1.0}, "reward_model": {"scorer": "a:b"}}, "takes no"),
    ({"rules": {"succeeded": 1.0}, "reward_model": {"url": "http://x"}}, "needs the judge's model name"),
    ({"rules": {"succeeded": 1.0}, "weights": {}}, "unknown keys ['weights']"),
    ({"rules": {"final": 1.0}}, "may not be named 'final'"),
    ({"rules": {"succeeded": 1.0}, "human": {"interval": -1}}, "human.interval"),
    ({}, "needs [rules], a [reward_model] or a [rank_judge]"),
    ({"reward_type": "rule"}, "has no component"),
])
def test_a_bad_configuration_is_a_clear_error(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Scorer(RewardConfig.from_dict(data))
    assert message in str(info.value)


def test_a_bad_file_names_itself(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[rules\n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        RewardConfig.load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        RewardConfig.load(tmp_path / "missing.toml")


def test_a_rollout_is_scored_as_it_ends_and_every_component_is_stored(store: TraceStore) -> None:
    client = client_for(store)
    with judge_server() as (url, seen):
        cfg = RewardConfig.from_dict(tomllib.loads(SEEDS_TOML.replace("JUDGE", url + "/v1")))
        with rollout("fix-1", store=store, rewards=cfg, input={"bug": "off by one"}) as good:
            tool_agent(client, "fix it", "all tests passed")
            good.reward(1.0)  # the agent's own report: an input of task_complete
        with rollout("fix-1", store=store, rewards=cfg) as bad:
            tool_agent(client, "fix it", 'File "x.py", line 1\nSyntaxError: invalid syntax')
    assert len(seen) == 2 and seen[0]["model"] == "judge" and "off by one" in seen[0]["messages"][1]["content"]
    h = cfg.hash
    ok = _by_name(store, good.id, h)
    assert {n: r.value for n, r in ok.items()} == {
        "tool_call_valid": 1.0, "task_complete": 1.0, "syntax_error": 0.0, "repeated_tool_calls": 0.0,
        "reward_model": 0.8, "final": 1.0 + 5.0 + 2.0 * 0.8}
    assert ok["reward_model"].metadata["detail"]["raw"] == 8.0 and ok["reward_model"].metadata["weight"] == 2.0
    assert ok["final"].final and ok["final"].metadata["absent"] == ["human"]
    # The agent's own reward is kept as "agent", not final; the final reward is the combination.
    assert [(r.name, r.final, r.config_hash) for r in store.rewards(good.id) if r.config_hash is None] == [
        ("agent", False, None)]
    assert store.get_rollout(good.id).final_reward == pytest.approx(7.6)
    worse = _by_name(store, bad.id, h)
    assert worse["syntax_error"].value == 1.0 and worse["task_complete"].value == 0.0
    assert worse["syntax_error"].metadata["detail"]["matched"][0]["text"] == "SyntaxError"
    assert store.get_rollout(bad.id).final_reward == pytest.approx(1.0 - 2.0 + 2.0 * 0.2)
    assert store.get_rollout(bad.id).status == "succeeded"


@pytest.mark.parametrize("where", ["down", "vague"])
def test_a_failing_judge_drops_the_final_reward_and_says_why(store: TraceStore, where: str) -> None:
    client = client_for(store)
    with judge_server() as (url, _):
        cfg = RewardConfig.from_dict({"rules": {"succeeded": 1.0},
                                      "reward_model": {"url": f"{url}/{where}/v1", "model": "j", "retries": 1}})
        with rollout("t", store=store, rewards=cfg) as r:
            tool_agent(client, "q", "ok")
    got = _by_name(store, r.id, cfg.hash)
    assert "final" not in got and store.get_rollout(r.id).final_reward is None  # never trained on a partial sum
    assert got["succeeded"].value == 1.0
    assert "reward_model" in got["reward_errors"].metadata["errors"]
    assert ("503" if where == "down" else "no score") in got["reward_errors"].metadata["errors"]["reward_model"]
    # "partial" keeps the rest.
    partial = Scorer(RewardConfig.from_dict({"rules": {"succeeded": 1.0}, "on_error": "partial",
                                             "reward_model": {"url": "http://127.0.0.1:9/v1", "model": "j",
                                                              "retries": 0, "timeout_s": 2}}))
    assert partial.score_rollout(store, r.id).scored.final == 1.0 and store.get_rollout(r.id).final_reward == 1.0


def _count_calls(t) -> float:
    return float(len(t.calls))


def test_own_rules_local_scorer_and_a_rule_that_raises(store: TraceStore) -> None:
    def broken(_t) -> float:
        raise RuntimeError("rule bug")

    cfg = RewardConfig.from_dict({
        "on_error": "partial",
        "rules": {"turns": {"function": "tests.rewards.test_rewards:_count_calls", "weight": 0.5},
                  "found": {"function": lambda t, word: Score(float(word in (t.final_output or "")), {"w": word}),
                            "weight": 1.0, "word": "echo"},
                  "broken": {"function": broken, "weight": 9.0}},
        "reward_model": {"scorer": lambda t: 0.25, "weight": 4.0, "scale": 2.0, "offset": 0.1}})
    client = client_for(store)
    with rollout("t", store=store, rewards=cfg) as r:
        tool_agent(client, "q", "ok")
    got = _by_name(store, r.id, cfg.hash)
    assert got["turns"].value == 2.0 and got["found"].value == 1.0 and got["found"].metadata["detail"] == {"w": "echo"}
    assert got["reward_model"].value == pytest.approx(0.6)
    assert "RuntimeError: rule bug" in got["reward_errors"].metadata["errors"]["broken"]
    assert got["final"].value == pytest.approx(0.5 * 2 + 1.0 + 4.0 * 0.6)


def test_guards_catch_the_seeds_reward_hacks() -> None:
    ro = Rollout(id="r", task_id="t", status=RolloutStatus.SUCCEEDED)
    loop = [tool_call(i, "run_python", {"query": "pytest"}) for i in range(4)]
    t = build_trajectory(ro, loop, [])
    assert guards.repeated_tool_calls(t, max_repeats=1).value == 3.0
    assert guards.repeated_tool_calls(t, max_repeats=4).value == 0.0
    varied = build_trajectory(ro, [tool_call(i, "run_python", {"query": f"step {i}"}) for i in range(4)], [])
    assert guards.repeated_tool_calls(varied, max_repeats=1).value == 0.0

    padding = " ".join(["the answer is yes"] * 40)
    long_text = "x" * 5000
    t = build_trajectory(ro, [tool_call(0, "", {}, content=padding), tool_call(1, "", {}, content=long_text),
                              tool_call(2, "", {}, content="Fixed the off-by-one in range(n + 1).")], [])
    flagged = guards.overlong_output(t).detail["flagged"]
    assert [f["reply"] for f in flagged] == [0, 1] and "distinct" in flagged[0]["why"][0]
    assert guards.overlong_output(t, max_chars=None, min_distinct=None).value == 0.0

    hacks = [
        tool_call(0, "write_file", {"path": "tests/test_sort.py", "content": "def test_sort():\n    pass"}),
        tool_call(1, "run_shell", {"command": "rm tests/test_sort.py"}),
        tool_call(2, "edit_file", {"path": "src/sort.py", "content": "@pytest.mark.skip\ndef f(): ..."}),
        tool_call(3, "run_shell", {"command": "pytest -q || true"}),
        tool_call(4, "run_shell", {"command": "pytest -q tests/test_sort.py"}),  # honest: runs the tests
        tool_call(5, "edit_file", {"path": "src/sort.py", "content": "return sorted(xs)"}),  # honest: fixes code
    ]
    found = guards.tests_bypassed(build_trajectory(ro, hacks, []))
    assert found.value == 4.0 and [f["call_index"] for f in found.detail["flagged"]] == [0, 1, 2, 3]
    assert found.detail["flagged"][1]["why"] == ["changes a test file from the shell"]


def test_tool_call_validity_and_errors_from_stored_calls() -> None:
    ro = Rollout(id="r", task_id="t", status=RolloutStatus.SUCCEEDED)
    calls = [tool_call(0, "run_python", {"query": "1"}), tool_call(1, "run_python", "{not json"),
             tool_call(2, "unknown_tool", {"a": 1}),
             tool_call(3, "", {}, content="done", results=("Traceback (most recent call last):\nValueError: x",))]
    scorer = Scorer(RewardConfig.from_dict({"rules": {"tool_call_valid": 1.0, "tool_error": -1.0,
                                                      "syntax_error": -2.0}}))
    scored = scorer.score(build_trajectory(ro, calls, []))
    assert scored.values == {"tool_call_valid": pytest.approx(1 / 3), "tool_error": 1.0, "syntax_error": 0.0}
    assert scored.final == pytest.approx(1 / 3 - 1.0)
    # No tool calls: the validity rule is absent unless told what to give.
    none = build_trajectory(ro, [tool_call(0, "", {}, content="hi")], [])
    assert "tool_call_valid" not in scorer.score(none).values
    with_default = Scorer(RewardConfig.from_dict({"rules": {"tool_call_valid": {"weight": 1.0, "if_none": 0.0}}}))
    assert with_default.score(none).values == {"tool_call_valid": 0.0}


def test_late_rewards_are_kept_and_recombined_until_a_trainer_takes_the_rollout(store: TraceStore) -> None:
    cfg = RewardConfig.from_dict({"rules": {"task_complete": 5.0}, "human": {"weight": 2.0}})
    client = client_for(store)
    with rollout("t", store=store, rewards=cfg) as r:
        tool_agent(client, "q", "ok")
    assert store.get_rollout(r.id).final_reward == 0.0  # nothing reported yet
    r.reward(1.0)  # the agent's verdict arrives after the end: kept, and the final reward follows it
    [agent] = [x for x in store.rewards(r.id) if x.name == "agent"]
    assert agent.metadata == {"late": True} and store.get_rollout(r.id).final_reward == 5.0
    store.add_reward(Reward(r.id, 0.5, name="human", final=False))  # a person's label, e.g. the labelling page
    assert Scorer(cfg).score_rollout(store, r.id, reuse_model=True).applied
    assert store.get_rollout(r.id).final_reward == 6.0
    # Once a trainer has consumed it, a late reward is stored with its recombination, but the
    # number trained on stays.
    store.claim_rollouts([r.id], "trainer0")
    store.commit_train_step(TrainStep(step=1, rollout_ids=(r.id,), trainer_id="trainer0"))
    r.reward(0.0)
    finals = [x.value for x in store.rewards(r.id) if x.name == "final"]
    assert finals == [0.0, 5.0, 6.0, 1.0] and store.get_rollout(r.id).final_reward == 6.0


def test_without_a_configuration_a_late_reward_is_kept_too(store: TraceStore) -> None:
    with rollout("t", store=store) as r:
        pass
    r.reward(0.5)
    assert store.flush()
    [late] = store.rewards(r.id)
    assert late.metadata == {"late": True} and store.get_rollout(r.id).final_reward == 0.5


def test_a_scored_rollout_reads_back_as_its_trajectory(store: TraceStore) -> None:
    client = client_for(store)
    with rollout("t", store=store) as r:
        tool_agent(client, "what is 2+2", "4")
    t = load_trajectory(store, r.id)
    assert [tc.name for tc in t.tool_calls] == ["run_python"] and t.tool_calls[0].valid
    assert [x.content for x in t.tool_results] == ["4"] and t.tool_results[0].name == "run_python"
    assert t.final_output == "echo: 4" and [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    with pytest.raises(KeyError, match="no rollout 'nope'"):
        load_trajectory(store, "nope")
