"""The SmolLM2 demo's task, reward, tool, template and SFT masking (fast: no server, no SmolLM2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer_backend.demo.arith import (
    SMOLLM2_TOOLS_TEMPLATE,
    calculate,
    final_number,
    held_out_problems,
    make_problems,
    reward,
)


def test_problems_are_seeded_split_and_exact() -> None:
    a, b = make_problems(200, 0, "train"), make_problems(200, 0, "train")
    assert a == b
    held_out = {p["question"] for p in make_problems(200, 0, "eval")}
    assert len(held_out & {p["question"] for p in a}) < 5  # separate streams; a rare collision at most
    assert make_problems(50, 1, "train") != a[:50]
    for p in a:
        assert calculate(p["expression"]) == str(p["answer"])
        assert p["answer"] > 0 and str(p["expression"].split()[0]) in p["question"]
    assert {p["expression"].split()[1] for p in a} == {"+", "-", "*"}


def test_held_out_problems_ask_no_question_a_train_or_warm_start_problem_asks() -> None:
    """The arithmetic demo's split as `lightning-mw demo --task arith` builds it: seed 0's first 128
    eval problems include one train problem word for word; the held-out set skips it, keeps the
    stream's order, and is the same at every call."""
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from
    from trainer_backend.demo.smol import SmolDemoRun
    from trainer_backend.demo.smol_warm import arith_demonstrations

    run = SmolDemoRun(config_from(build_parser().parse_args(["demo", "--task", "arith", "--seed", "0"])))
    train = {p["question"] for p in run.train_tasks}
    ws = run._warm_start_config()
    shown = {m[1]["content"] for m, _ in arith_demonstrations(ws.steps * ws.batch, ws.seed)}
    asked = [p["question"] for p in run.eval_tasks]
    assert len(asked) == len(set(asked)) == 128 and not set(asked) & (train | shown)
    raw = make_problems(128, 0, "eval")
    assert sum(p["question"] in train | shown for p in raw) >= 1
    skipped = run.results["held_out"]["skipped_seen_or_repeated"]
    indices = [int(p["task_id"].removeprefix("eval-")) for p in run.eval_tasks]
    assert skipped >= 1 and indices == sorted(indices) and indices[-1] == 127 + skipped
    assert run.eval_tasks == held_out_problems(128, 0, train | shown)[0]
    with pytest.raises(ValueError, match="only 1 of 20 eval problems"):  # all but the first already asked
        held_out_problems(2, 0, {p["question"] for p in make_problems(20, 0, "eval")[1:]})
    assert held_out_problems(0, 0, set()) == ([], 0)


@pytest.mark.parametrize(("expr", "out"), [("412 - 178", "234"), (" 23*17 ", "391"), ("-3 + 5", "2"),
                                           ("7 / 2", "3.5"), ("8 / 2", "4"), ("(2 + 3) * 4", "20")])
def test_calculator_evaluates(expr: str, out: str) -> None:
    assert calculate(expr) == out


@pytest.mark.parametrize("expr", ["__import__('os')", "2 ** 10", "1 / 0", "abc", "", None, "True + 1",
                                  "10000000000000 * 2", "[1, 2]"])
def test_calculator_refuses_with_a_message(expr: Any) -> None:
    out = calculate(expr)
    assert out.startswith("error: ") and "cannot evaluate" in out


def test_reward_is_the_exact_last_number() -> None:
    assert reward("The answer is 234.", 234) == 1.0
    assert reward("412 - 178 = 234", 234) == 1.0
    assert reward("The answer is 1,234 apples", 1234) == 1.0
    assert reward("234 or maybe 235", 234) == 0.0
    assert reward("The answer is 233.", 234) == 0.0
    assert reward("", 234) == 0.0 and reward("no idea", 234) == 0.0
    assert final_number("it is -5") == -5.0 and final_number("2.50 left") == 2.5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from trainer_backend.models import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))
    tok.chat_template = SMOLLM2_TOOLS_TEMPLATE
    return tok


def test_template_renders_smollm2_tool_format(tokenizer: Any) -> None:
    from trainer_backend.demo.smol_warm import demonstration

    p = make_problems(1, 0, "eval")[0]
    text = tokenizer.apply_chat_template(demonstration(p), tools=[_schema()], tokenize=False)
    system, user, call, tool, answer = text.split("<|im_start|>")[1:]
    assert system.startswith("system\nSolve the math word problem.")
    assert '<tools>[{"name": "calculator"' in system and "<tool_call>[\n" in system
    assert user == f"user\n{p['question']}<|im_end|>\n"
    # the call as SmolLM2 writes one, a JSON list inside the tags (what vLLM's xlam parser reads)
    inner = call.removeprefix("assistant\n<tool_call>").removesuffix("</tool_call><|im_end|>\n")
    assert json.loads(inner) == [{"name": "calculator", "arguments": {"expression": p["expression"]}}]
    assert tool == f"tool\n{p['answer']}<|im_end|>\n"
    assert answer == f"assistant\nThe answer is {p['answer']}.<|im_end|>\n"
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert plain == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                     "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # SmolLM2's own


def test_sft_mask_covers_only_the_assistant_turns(tokenizer: Any) -> None:
    from trainer_backend.demo.smol_warm import demonstration, sft_example

    p = make_problems(1, 3, "sft")[0]
    ids, mask = sft_example(tokenizer, demonstration(p))
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask) / 2
    learned = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert p["expression"] in learned and f"The answer is {p['answer']}." in learned
    assert p["question"] not in learned and "Solve the math" not in learned


def _schema() -> dict[str, Any]:
    from trainer_backend.demo.smol_warm import TOOL_SCHEMA

    return TOOL_SCHEMA


def test_tool_schema_is_what_langchain_sends() -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from trainer_backend.demo.smol import calculator_tool

    tool = calculator_tool()
    assert convert_to_openai_tool(tool) == _schema()
    assert tool.invoke({"expression": "6 * 7"}) == "42"


def test_episode_outcome_reads_the_agent_messages() -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from trainer_backend.demo.smol import episode_outcome

    call = {"name": "calculator", "args": {"expression": "2 + 2"}, "id": "c0", "type": "tool_call"}
    good = [HumanMessage("q"), AIMessage("", tool_calls=[call]), ToolMessage("4", tool_call_id="c0"),
            AIMessage("The answer is 4.")]
    assert episode_outcome(good, 4) == {"reward": 1.0, "tool_called": 1.0, "turns": 2, "end": "answered"}
    assert episode_outcome(good, 5)["reward"] == 0.0
    no_tool = [HumanMessage("q"), AIMessage("It is 4.")]
    assert episode_outcome(no_tool, 4) == {"reward": 1.0, "tool_called": 0.0, "turns": 1, "end": "answered"}
    assert episode_outcome([HumanMessage("q")], 4)["end"] == "no_answer"


def test_tools_model_links_weights_and_writes_the_template(tmp_path: Path) -> None:
    from trainer_backend.demo.smol_warm import MODEL_FILES, tools_model

    src = tmp_path / "converted"
    src.mkdir()
    for name in MODEL_FILES:
        (src / name).write_text(name)
    out = tools_model(src, tmp_path / "tools")
    assert all((out / n).is_symlink() and (out / n).read_text() == n for n in MODEL_FILES)
    assert (out / "chat_template.jinja").read_text() == SMOLLM2_TOOLS_TEMPLATE
    assert tools_model(src, out) == out  # idempotent


def test_cli_takes_smollm2_with_arith_only() -> None:
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from, run_cli

    args = build_parser().parse_args(["demo", "--model", "smollm2", "--task", "arith", "--lora-rank", "16"])
    cfg = config_from(args)
    assert cfg.model_dir is None and cfg.task == "arith" and cfg.extra == {"lora_rank": 16}
    assert cfg.out_dir == "runs/demo-smol-arith-0"
    assert config_from(build_parser().parse_args(["demo", "--model", "smollm2", "--task", "arith"])).extra == {}
    assert run_cli(build_parser().parse_args(["demo", "--task", "arith"])) == 2  # arith needs smollm2
    assert run_cli(build_parser().parse_args(["demo", "--model", "smollm2"])) == 2  # and smollm2 arith
