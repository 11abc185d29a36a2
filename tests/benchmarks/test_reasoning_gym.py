"""reasoning-gym as a task source (lightning_middleware/benchmarks/reasoning.py): addresses, the
tasks they name (reasoning-gym's own items, rebuilt the same everywhere), and scores from the
dataset's own `score_answer` through a reward configuration on real rollouts."""

from __future__ import annotations

import pytest

from lightning_middleware import RewardConfig, TraceStore, rollout
from lightning_middleware.benchmarks import reasoning
from lightning_middleware.benchmarks.reasoning import BenchmarkError, parse
from lightning_middleware.controller.tasks import load_tasks
from tests.rewards.helpers import client_for

reasoning_gym = pytest.importorskip("reasoning_gym")
ADDRESS = "rg:basic_arithmetic?size=20&seed=3&max_terms=3"


def test_an_address_names_a_dataset_its_size_seed_and_config() -> None:
    a = parse(ADDRESS)
    assert (a.name, a.size, a.seed, a.config) == ("basic_arithmetic", 20, 3, (("max_terms", 3),))
    assert parse(str(a)) == a and parse("rg:chain_sum").size == reasoning.DEFAULT_SIZE
    listed = parse('rg:basic_arithmetic?size=3&operators=["+"]')  # a list value: hashable, cached, taken
    assert listed.config == (("operators", ("+",)),) and parse(str(listed)) == listed
    assert all(" - " not in t["question"] and " * " not in t["question"] for t in reasoning.tasks(str(listed)))
    for bad, why in (("rg:", "rg:NAME"), ("bfcl:x", "rg:NAME"), ("rg:x?size=ten", "integers"),
                     ("rg:x?size=0", "positive"), ("rg:no_such_dataset?size=3", "no dataset 'no_such_dataset'"),
                     ("rg:basic_arithmetic?size=3&no_such_key=1", "reasoning-gym refused it")):
        with pytest.raises(BenchmarkError, match=why):
            load_tasks(bad) if bad.startswith("rg:no_such") else reasoning.tasks(bad)
    with pytest.raises(BenchmarkError) as unknown:  # the valid names, listed
        reasoning.tasks("rg:no_such_dataset?size=3")
    assert "basic_arithmetic, " in str(unknown.value) and "spell_backward" in str(unknown.value)


def test_the_tasks_are_reasoning_gyms_own_items_the_same_every_time() -> None:
    tasks = load_tasks(ADDRESS)
    own = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=3, max_terms=3)
    assert len(tasks) == 20 and len({tid for tid, _ in tasks}) == 20
    assert [t["question"] for _, t in tasks] == [own[i]["question"] for i in range(20)]
    assert [t for _, t in tasks] == [t for _, t in load_tasks(ADDRESS)]
    assert tasks[4][0] == "rg:basic_arithmetic:3:4" and tasks[4][1]["rg"] == {"address": str(parse(ADDRESS)),
                                                                             "index": 4}


def test_scores_are_the_datasets_own_partial_credit_included() -> None:
    own = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=3, max_terms=3)
    for (_, task), i in zip(load_tasks(ADDRESS)[:5], range(5)):
        right = own[i]["answer"]
        for answer in (right, f" {right} ", f"The answer is {right}.", "not a number"):
            assert reasoning.score(answer, task) == own.score_answer(answer=answer, entry=own[i])
        assert reasoning.score(right, task) == 1.0 and reasoning.score("not a number", task) == 0.0
    assert reasoning.final_answer("work... <answer> 12 </answer>") == "12"
    assert reasoning.final_answer(" 12\n") == "12"
    with pytest.raises(BenchmarkError, match="not a reasoning-gym task"):
        reasoning.score("1", {"question": "q"})


def test_a_rollout_is_scored_by_the_benchmark_through_the_reward_configuration(store: TraceStore) -> None:
    """The agent's final output is the test LLM's reply ("echo: " + the last message): asked to
    echo `<answer>X</answer>`, its output carries the answer X, which reasoning-gym scores."""
    client = client_for(store)
    cfg = RewardConfig.from_dict({"rules": {"benchmark": {
        "function": "lightning_middleware.benchmarks.reasoning:rg_score", "weight": 1.0}}})
    own = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=3, max_terms=3)
    (tid, task), *_ = load_tasks(ADDRESS)
    finals = {}
    for answer in (own[0]["answer"], "99999"):
        with rollout(tid, store=store, input=task, rewards=cfg) as r:
            client.chat.completions.create(model="m", messages=[
                {"role": "user", "content": f"<answer>{answer}</answer> {task['question']}"}])
        finals[answer] = r.id
    right, wrong = (store.get_rollout(rid) for rid in finals.values())
    assert (right.final_reward, wrong.final_reward) == (1.0, 0.0)
    [component] = [r for r in store.rewards(right.id) if r.name == "benchmark"]
    assert component.metadata["detail"] == {"answer": own[0]["answer"], "solved": True}
    # a rollout whose task is no reasoning-gym task: the component is absent, not a zero
    with rollout("plain", store=store, input={"question": "hi"}, rewards=cfg) as r:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert [x.name for x in store.rewards(r.id) if x.name == "benchmark"] == []
