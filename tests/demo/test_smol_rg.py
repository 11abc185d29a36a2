"""`lightning-mw demo --task rg:NAME`'s own parts: its splits, its warm-start demonstrations, its
evaluation by the dataset's own scorer through the controller, its command line. The full run
(serve, evaluate, RL) is a benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.benchmarks import reasoning
from lightning_middleware.controller import RolloutController
from lightning_middleware.testing import LLMTestServer
from trainer_backend.demo.smol import evaluation_pass
from trainer_backend.demo.smol_rg import (
    EVAL_SEED,
    RULES,
    SFT_SEED,
    TRAIN_SEED,
    ReasoningDemoRun,
    demonstrations_for,
    held_out,
    make_rg_agent,
    outcomes,
    split,
    split_seed,
)

pytest.importorskip("reasoning_gym", reason="the set-up installs the benchmarks extra")
TASK = "rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2"
SMALL = "rg:chain_sum?min_terms=2&max_terms=3&min_digits=1&max_digits=1"  # a small question space: seeds repeat items


def test_held_out_items_ask_no_question_a_train_or_warm_start_item_asks() -> None:
    """The demo's own splits, as `lightning-mw demo --task` builds them: on a dataset small enough
    that another seed draws the same questions, the held-out set skips them (and its own repeats),
    keeps the order of its seed, and is the same at every call."""
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from

    for address in (SMALL, TASK):
        run = ReasoningDemoRun(config_from(build_parser().parse_args(["demo", "--task", address, "--seed", "1"])))
        train = {t["question"] for t in run.train_tasks}
        shown = {m[1]["content"] for m, _ in demonstrations_for(address)(6 * 4, 0)}
        asked = [t["question"] for t in run.eval_tasks]
        assert len(asked) == len(set(asked)) == 256 and not set(asked) & (train | shown)
        raw = [t["question"] for t in reasoning.tasks(split(address, 256, split_seed(EVAL_SEED, 1)))]
        skipped = run.results["held_out"]["skipped_seen_or_repeated"]
        assert sum(q in train for q in raw) > 0 and skipped >= sum(q in train for q in raw)
        indices = [t["rg"]["index"] for t in run.eval_tasks]
        assert indices == sorted(indices) and indices[-1] == 255 + skipped
        assert [t["task_id"] for t in run.eval_tasks] == [t["task_id"] for t in held_out(
            address, 256, split_seed(EVAL_SEED, 1), train | shown)[0]]


def test_each_run_seed_draws_its_own_questions() -> None:
    """reasoning-gym's item i of seed S is Random(S + i): with seeds one apart, runs 0 and 1 shared
    255 of 256 held-out questions and their whole train set. Strided, they share what chance gives."""
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from

    runs = [ReasoningDemoRun(config_from(build_parser().parse_args(["demo", "--task", TASK, "--seed", str(k)])))
            for k in (0, 1)]
    held = [{t["question"] for t in run.eval_tasks} for run in runs]
    train = [{t["question"] for t in run.train_tasks} for run in runs]
    assert len(held[0] & held[1]) < 64 and len(train[0] & train[1]) < 0.9 * len(train[0])
    assert split_seed(TRAIN_SEED, 0) == TRAIN_SEED and split_seed(EVAL_SEED, 0) == EVAL_SEED  # seed 0 as before


def test_a_dataset_too_small_for_its_held_out_set_says_so_in_one_line() -> None:
    tiny = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1"  # at most 200 questions
    seen = {t["question"] for t in reasoning.tasks(split(tiny, 2000, TRAIN_SEED))}
    with pytest.raises(reasoning.BenchmarkError, match="too small for 20 held-out items") as err:
        held_out(tiny, 20, EVAL_SEED, seen)
    assert "\n" not in str(err.value)
    some, skipped = held_out(tiny, 20, EVAL_SEED, set())  # with nothing trained on, only repeats skip
    assert len({t["question"] for t in some}) == 20 and some[-1]["rg"]["index"] == 19 + skipped
    with pytest.raises(ValueError, match="at least 1, got 0"):  # it walked forever before
        held_out(tiny, 0, EVAL_SEED, set())


def test_each_split_has_its_own_seed_and_keeps_the_datasets_config() -> None:
    train, held_out = split(TASK, 50, TRAIN_SEED + 3), split(TASK, 20, EVAL_SEED + 3)
    a, b = reasoning.parse(train), reasoning.parse(held_out)
    assert (a.name, a.size, a.seed) == ("basic_arithmetic", 50, 3) and (b.size, b.seed) == (20, 1_000_003)
    assert a.config == b.config == reasoning.parse(TASK).config and dict(a.config)["max_digits"] == 2
    assert len({TRAIN_SEED, EVAL_SEED, SFT_SEED}) == 3
    assert [t["question"] for t in reasoning.tasks(train)] != [t["question"] for t in reasoning.tasks(
        split(TASK, 50, EVAL_SEED + 3))]


def test_demonstrations_answer_in_tags_that_the_dataset_scores_one() -> None:
    demos = demonstrations_for(TASK)(8, 0)
    address = split(TASK, 8, SFT_SEED)
    for i, (messages, tools) in enumerate(demos):
        system, user, answer = messages
        assert tools == [] and system["role"] == "system" and user["content"] == reasoning.tasks(address)[i]["question"]
        assert answer["content"].startswith("<answer>") and answer["content"].endswith("</answer>")
        task = reasoning.tasks(address)[i]
        assert reasoning.score(reasoning.final_answer(answer["content"]), task) == 1.0


def test_the_evaluation_is_the_datasets_score_at_the_tasks_temperature(llm_server: LLMTestServer,
                                                                       tmp_path: Path) -> None:
    """The test LLM echoes the question: nothing is solved, nothing is in tags, and each rollout's
    reward is the dataset's own score of that echo; the agent sends the pass's temperature."""
    store = TraceStore(f"sqlite:///{tmp_path / 'store.db'}")
    tasks = reasoning.tasks(split(TASK, 4, EVAL_SEED))
    try:
        with RolloutController(make_rg_agent(llm_server.base_url, store, model="m"), store=store, concurrency=2,
                               rewards=RewardConfig.from_dict(RULES)) as c:
            res = evaluation_pass(c, store, tasks, temperature=0.0, tag="before-greedy", outcomes=outcomes)
        assert (res["n"], res["success"], res["tagged"], res["errors"]) == (4, 0.0, 0.0, 0)
        for r in store.query_rollouts(limit=10):
            [call] = store.calls(r.id)
            assert call.request["temperature"] == 0.0 and call.completion_token_ids
            [component] = [w for w in store.rewards(r.id) if w.name == "rg"]
            task = r.input
            assert component.value == reasoning.score(reasoning.final_answer(
                call.response["choices"][0]["message"]["content"]), task)
    finally:
        store.close()


def test_the_command_line_takes_a_reasoning_gym_address() -> None:
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import RG_RECIPE, config_from, run_cli

    cfg = config_from(build_parser().parse_args(["demo", "--task", TASK, "--seed", "2"]))
    assert (cfg.task, cfg.model_dir, cfg.extra, cfg.out_dir) == (TASK, None, {"rg": TASK},
                                                                 "runs/demo-smol-rg-basic_arithmetic-2")
    assert (cfg.minutes, cfg.eval_tasks, cfg.lr) == (RG_RECIPE["minutes"], RG_RECIPE["eval_tasks"], RG_RECIPE["lr"])
    for bad in ("rg:", "rg:basic_arithmetic?size=x", "sudoku"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["demo", "--task", bad])
    assert run_cli(build_parser().parse_args(["demo", "--task", TASK, "--model", "/some/folder"])) == 2


@pytest.mark.parametrize("flag", ["--eval-tasks", "--groups-per-step", "--group-size", "--groups-in-flight"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_a_count_flag_below_one_is_refused_in_one_line(flag: str, value: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_middleware.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--task", TASK, flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in err and repr(value) in err
