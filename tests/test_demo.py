"""`lightning-mw demo`: fast checks of the task, template and CLI, and one slow end-to-end
run (vLLM CPU server, wrap() capture, SQLite store, trainer daemon, weight swap) that
asserts held-out success rises. The margin is chosen from the measured spread of
several runs (docs/demo.md, "CI test").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer_backend.demo_task import (HIGH, LOW, MAX_GUESSES, TOOL_SCHEMA, WarmStartConfig, answer,
                                       bisection_guesses, episode_messages, make_tasks, tool_call_text)

# Held-out sampled-success gain the short CI run must reach, in percentage points. Measured
# for this configuration (seed 0, CI_MINUTES of async RL, 256 held-out tasks, the demo's
# default lr warm-up + decay): +18.4 pp at peak lr 3e-4 with the dual clip (the default),
# +20.3 pp at 3e-4 without it, +17.6 and +22.7 pp at 5e-4 (and +17.2 pp with the earlier flat lr);
# 8 pp is ~2 sigma of the evaluation noise below the lowest (docs/demo.md, "CI test").
CI_MINUTES = 4.0
CI_MIN_GAIN_PP = 8.0


def test_game_rules_and_bisection_always_wins() -> None:
    assert answer(8, 8) == "correct" and answer(9, 8) == "higher" and answer(7, 8) == "lower"
    assert answer(5, "x") == "invalid"
    for secret in range(LOW, HIGH + 1):
        g = bisection_guesses(secret)
        assert g[-1] == secret and len(g) <= MAX_GUESSES


def test_tasks_are_fixed_by_seed_and_split() -> None:
    assert make_tasks(5, 0, "eval") == make_tasks(5, 0, "eval")
    assert make_tasks(50, 0, "eval") != make_tasks(50, 0, "train")
    assert {t["task_id"] for t in make_tasks(3, 1, "eval")} == {"eval-0", "eval-1", "eval-2"}


def test_langchain_tool_schema_is_what_the_model_was_trained_on() -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from lightning_middleware.demo import guess_tool

    assert convert_to_openai_tool(guess_tool()) == TOOL_SCHEMA


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from trainer_backend.demo_task import build_base_model

    return build_base_model(tmp_path_factory.mktemp("demo-base"), WarmStartConfig())


def test_template_renders_tools_and_hermes_calls_and_sft_mask(base_model: Path) -> None:
    from transformers import AutoTokenizer

    from trainer_backend.demo_task import sft_example

    tok = AutoTokenizer.from_pretrained(base_model)
    msgs = episode_messages(11, bisection_guesses(11))
    text = tok.apply_chat_template(msgs, tools=[TOOL_SCHEMA], tokenize=False)
    assert '"name": "guess"' in text.split("</tools>")[0]  # the tool schema is in the prompt
    assert tool_call_text(8) in text and "<tool_response>\nhigher\n</tool_response>" in text
    ids, mask = sft_example(tok, 11)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "".join(tool_call_text(g) + "<|im_end|>" for g in bisection_guesses(11))
    # each turn's prompt is a token prefix of the next one (one training row per rollout)
    prev: list[int] = []
    for k in range(len(bisection_guesses(11))):
        p = tok.apply_chat_template(msgs[:2 + 2 * k], tools=[TOOL_SCHEMA], tokenize=True,
                                    add_generation_prompt=True, return_dict=False)
        assert p[:len(prev)] == prev
        prev = p


def test_cli_registers_demo() -> None:
    from lightning_middleware.cli import build_parser

    args = build_parser().parse_args(["demo", "--sync", "--minutes", "1", "--seed", "3"])
    assert args.sync and args.minutes == 1 and args.seed == 3 and args.func.__name__ == "_cmd_demo"
    assert args.lr == 3e-4 and args.lr_end == 1e-4 and args.lr_warmup_steps == 10  # the recipe
    assert args.dual_clip == 3.0
    assert build_parser().parse_args(["demo", "--lr-end", "0"]).lr_end == 0  # 0: constant lr


@pytest.mark.slow
@pytest.mark.vllm
def test_short_demo_learns(tmp_path: Path) -> None:
    """~5 min on 2 cores (+~2.5 min the first time, to build the warm start cached under $LIGHTNING_HOME/demo)."""
    pytest.importorskip("torch")
    pytest.importorskip("langchain_openai")
    from lightning_middleware import serving
    from lightning_middleware.demo import DemoConfig, run_demo

    if not serving.vllm_python().exists() and os.environ.get("LIGHTNING_TEST_INSTALL_VLLM") != "1":
        pytest.skip("no vLLM environment: run `lightning-mw vllm-env`")
    res = run_demo(DemoConfig(out_dir=str(tmp_path / "demo"), seed=0, minutes=CI_MINUTES, greedy=False,
                              progress=False))
    before, after = res["before"]["sampled"]["success"], res["after"]["sampled"]["success"]
    assert res["before"]["sampled"]["n"] == 256 and res["before"]["sampled"]["errors"] == 0
    assert 0.10 <= before <= 0.60, f"baseline {before:.1%} outside 10-60%"
    assert res["steps"] >= 5
    # the real path: every trained rollout came through wrap() with token IDs (>= 1 row each).
    # Prefix breaks are not asserted: RL may drift the unrewarded "\n" before </tool_call>,
    # which the template re-renders, so turns split into rows (still trained correctly; docs/demo.md).
    assert all(c.get("rows_rows", 0) >= c["rollouts"] > 0 for c in res["curve"])
    assert sum(c.get("rows_calls_used", 0) for c in res["curve"]) > sum(c["rollouts"] for c in res["curve"])
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 10_000
    gain = 100 * (after - before)
    assert gain >= CI_MIN_GAIN_PP, f"held-out success {before:.1%} -> {after:.1%} ({gain:+.1f} pp)"


def test_lr_schedule_warms_up_by_step_then_decays_by_budget() -> None:
    from lightning_middleware.demo import DemoConfig, _lr_at

    cfg = DemoConfig(lr=5e-4, lr_end=1e-4, lr_warmup_steps=10)
    warm = [_lr_at(cfg, k, 0.0) for k in range(1, 11)]
    assert warm[0] == pytest.approx(5e-5) and warm[-1] == pytest.approx(5e-4)
    assert all(a < b for a, b in zip(warm, warm[1:]))
    assert _lr_at(cfg, 11, 0.0) == pytest.approx(5e-4)
    assert _lr_at(cfg, 40, 0.5) == pytest.approx(3e-4)
    assert _lr_at(cfg, 90, 1.3) == pytest.approx(1e-4)  # past the budget: stays at the end value
    assert _lr_at(cfg, 3, 0.9) == pytest.approx(1.5e-4)  # warm-up wins while it lasts
    flat = DemoConfig(lr=5e-4, lr_end=None, lr_warmup_steps=0)
    assert {_lr_at(flat, k, k / 10) for k in range(1, 20)} == {5e-4}
