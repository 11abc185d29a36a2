"""A short run of the SmolLM2 recipe end to end (issue 21): the real pretrained model, its SFT
warm start, LangChain's `create_agent` through `wrap()`, RL on the vLLM CPU server, held-out.

The CI run is the command line's own recipe (`lightning-mw demo --model smollm2 --task arith`,
ARITH_RECIPE) with a budget of CI_STEPS RL steps instead of 20 minutes, capped at
CI_MAX_MINUTES. The margin comes from measured runs of exactly this configuration
(docs/demo.md, "SmolLM2 CI test"); 128 held-out problems give a difference of two success rates
near 75% a standard deviation of ~5.4 pp from sampling alone, so the test asks for a gain above
zero: learning, not its size (the 20-minute recipe's +16 to +24 pp say that).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

CI_STEPS = 6
CI_MAX_MINUTES = 25.0
CI_MIN_GAIN_PP = 0.0  # measured +9.4 and +10.9 pp (docs/demo.md): ~1.8 sigma of the evaluation's noise below


def test_the_arith_command_runs_the_measured_recipe() -> None:
    """`lightning-mw demo --model smollm2 --task arith` alone is the recipe of docs/demo.md (the main
    demo's lr of 3e-4 collapses this model); any flag still overrides its one setting."""
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from
    from trainer_backend.demo.smol import SFT_STEPS

    parse = build_parser().parse_args
    cfg = config_from(parse(["demo", "--model", "smollm2", "--task", "arith"]))
    assert (cfg.lr, cfg.lr_end, cfg.lr_warmup_steps, cfg.minutes) == (1e-5, None, 0, 20.0)
    assert (cfg.groups_per_step, cfg.group_size, cfg.groups_in_flight, cfg.eval_tasks) == (4, 4, 8, 128)
    assert cfg.sft_steps is None and SFT_STEPS == 6
    mine = config_from(parse(["demo", "--model", "smollm2", "--task", "arith", "--lr", "2e-5", "--group-size", "8",
                              "--lr-end", "1e-5", "--lr-warmup-steps", "2"]))
    assert (mine.lr, mine.lr_end, mine.lr_warmup_steps, mine.group_size, mine.groups_per_step) == (2e-5, 1e-5, 2, 8, 4)
    guess = config_from(parse(["demo"]))
    assert (guess.lr, guess.lr_end, guess.lr_warmup_steps, guess.group_size, guess.eval_tasks) == \
        (3e-4, 1e-4, 10, 8, 256)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_short_smol_demo_learns(tmp_path: Path) -> None:
    """14-16 min on 2 AVX512-BF16 cores (the SFT warm start, 90 s, cached afterwards)."""
    pytest.importorskip("torch")
    pytest.importorskip("langchain")
    from lightning_middleware.cli import build_parser
    from trainer_backend.demo.cli import config_from
    from trainer_backend.demo.run import run_demo
    from trainer_backend.demo.smol import SmolDemoRun
    from trainer_backend.serving import env as serving

    if not serving.vllm_python().exists() and os.environ.get("LIGHTNING_TEST_INSTALL_VLLM") != "1":
        pytest.skip("no vLLM environment: run `lightning-mw vllm-env`")
    args = build_parser().parse_args(["demo", "--model", "smollm2", "--task", "arith", "--seed", "0", "--no-greedy",
                                      "--max-steps", str(CI_STEPS), "--minutes", str(CI_MAX_MINUTES),
                                      "--out", str(tmp_path / "smol")])
    res = run_demo(replace(config_from(args), progress=False), SmolDemoRun)
    before, after = res["before"]["sampled"], res["after"]["sampled"]
    print(f"CI SmolLM2 demo on {res['machine']['kind']}: {before['success']:.1%} -> {after['success']:.1%}, "
          f"valid tool calls {before['valid_tool_call']:.1%} -> {after['valid_tool_call']:.1%}, "
          f"{res['steps']} steps in {res['timings']['rl_s'] / 60:.1f} min of RL")
    assert before["n"] == after["n"] == 128
    # the SFT warm start taught SmolLM2's tool-call format (the untouched model makes none)
    assert 0.40 <= before["success"] <= 0.90 and before["valid_tool_call"] >= 0.70, before
    assert res["steps"] == CI_STEPS, f"only {res['steps']} of {CI_STEPS} steps within {CI_MAX_MINUTES:g} min"
    # the real path: every trained rollout came through wrap() with the engine's token IDs, and the
    # template renders SmolLM2's calls back as sampled (multi-turn rows merge, few prefix breaks)
    curve = res["curve"]
    assert all(c.get("rows_rows", 0) >= c["rollouts"] > 0 for c in curve)
    assert sum(c.get("rows_merges", 0) for c in curve) > 0
    assert sum(c.get("rows_prefix_breaks", 0) for c in curve) <= 0.1 * sum(c.get("rows_merges", 0) for c in curve)
    assert (tmp_path / "smol" / "reward_curve.png").stat().st_size > 10_000
    gain = 100 * (after["success"] - before["success"])
    assert gain > CI_MIN_GAIN_PP, f"held-out {before['success']:.1%} -> {after['success']:.1%} ({gain:+.1f} pp)"
    assert after["valid_tool_call"] >= before["valid_tool_call"] - 0.05
