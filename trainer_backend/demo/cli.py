"""`lightning-mw demo` and `lightning-mw demo-compare`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from trainer_backend.algorithms.registry import ALGORITHMS
from trainer_backend.demo.report import plot_curve
from trainer_backend.demo.run import DemoConfig, run_demo
from trainer_backend.demo.task import DEMO_TURNS
from trainer_backend.serving.publisher import PauseMode

# The team task trains LoRA adapters (rank 16, alpha 16): they take a higher lr than the whole
# model (docs/policies.md has the runs).
TEAM_LR = (2e-3, 1e-3)
# SmolLM2 on arithmetic (--task arith): the recipe measured on three seeds (docs/demo.md). A
# constant lr of 1e-5 without warm-up (3e-5 collapsed the policy after two updates), small steps
# of 16 rollouts (a 135M model trains at ~60-90 tokens/s on 2 cores); its SFT is smol.py's.
ARITH_RECIPE: dict[str, Any] = {"minutes": 20.0, "eval_tasks": 128, "groups_per_step": 4, "group_size": 4,
                                "groups_in_flight": 8, "lr": 1e-5, "lr_end": None, "lr_warmup_steps": 0}
# SmolLM2 on BFCL (--task bfcl, demo/smol_bfcl.py): the arithmetic recipe, within the 30 minutes
# of RL, on all 147 held-out items of simple_python and multiple.
BFCL_RECIPE: dict[str, Any] = {**ARITH_RECIPE, "minutes": 30.0, "eval_tasks": 147}
# SmolLM2 on a reasoning-gym dataset (--task rg:NAME, demo/smol_rg.py): the same recipe; on
# basic_arithmetic, seed 0, greedy +14.8 pp in 30 min (docs/demo.md); 256 held-out items (~3 pp of noise at 50%).
RG_RECIPE: dict[str, Any] = {**ARITH_RECIPE, "minutes": 30.0, "eval_tasks": 256}
SMOL_TASKS = ("arith", "bfcl")  # the tasks SmolLM2 runs (--model smollm2; bfcl and rg:NAME imply it)
TASKS = ("guess", "team", *SMOL_TASKS)


def task_name(value: str) -> str:
    """A --task value: one of TASKS, or a reasoning-gym address (rg:NAME?KEY=VALUE...)."""
    if value in TASKS:
        return value
    if value.startswith("rg:"):
        from lightning_middleware.benchmarks.reasoning import BenchmarkError, parse

        try:
            parse(value)
        except BenchmarkError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: the tasks are {', '.join(TASKS)}, or rg:NAME (a reasoning-gym "
                                     "dataset, with its config keys: rg:NAME?KEY=VALUE)")


def positive(value: str) -> int:
    """A count flag's value: a whole number of at least 1 (0 held-out tasks or groups has no run)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: at least 1")
    return n


def _number_in(value: str, ok: Callable[[float], bool], what: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not ok(x):
        raise argparse.ArgumentTypeError(f"{value!r}: {what}")
    return x


def temperature(value: str) -> float:
    """--train-temperature: above 0 (greedy samples of a group are alike: no signal) and at most 2."""
    return _number_in(value, lambda t: 0 < t <= 2, "a sampling temperature above 0 and at most 2")


def probability(value: str) -> float:
    """--sit-out-uniform, --warm-start-habit: a chance in [0, 1]."""
    return _number_in(value, lambda p: 0 <= p <= 1, "a probability from 0 to 1")


def is_smol(task: str) -> bool:
    return task in SMOL_TASKS or task.startswith("rg:")


def add_cli(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a small LangChain tool agent with RL on CPU (vLLM + store + trainer)",
                       description="train a small LangChain tool agent with RL on CPU, end to end")
    d = DemoConfig()
    p.add_argument("--out", default=None, help="output dir (default runs/demo-SEED-MODE)")
    p.add_argument("--seed", type=int, default=d.seed, help="RL seed: which train/eval tasks")
    p.add_argument("--warm-start-seed", type=int, default=d.warm_start_seed)
    p.add_argument("--minutes", type=float, default=None, help=f"RL time budget (default {d.minutes:g}; arith 20)")
    p.add_argument("--sync", action="store_true", help="sync RL (no rollouts during updates), for comparison")
    recipe = "default {}; --task arith: its own recipe (ARITH_RECIPE, docs/demo.md)"
    p.add_argument("--eval-tasks", type=positive, default=None, help=recipe.format(d.eval_tasks))
    p.add_argument("--groups-per-step", type=positive, default=None, help=recipe.format(d.groups_per_step))
    p.add_argument("--group-size", type=positive, default=None, help=recipe.format(d.group_size))
    p.add_argument("--groups-in-flight", type=positive, default=None, help=recipe.format(d.groups_in_flight))
    p.add_argument("--max-staleness", type=int, default=d.max_staleness)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {d.lr:g}; the team task's LoRA adapters: {TEAM_LR[0]:g})")
    p.add_argument("--algo", choices=ALGORITHMS, default=d.algo,
                   help="the RL algorithm (docs/trainer.md, choosing and tuning)")
    p.add_argument("--dual-clip", type=float, default=d.dual_clip,
                   help="PPO dual clip c (> 1) for negative advantages; 0 turns it off")
    p.add_argument("--lr-warmup-steps", type=int, default=None, help=recipe.format(d.lr_warmup_steps))
    p.add_argument("--lr-end", type=float, default=None,
                   help=f"learning rate reached at the end of the budget (linear decay; default {d.lr_end:g}, "
                        f"team {TEAM_LR[1]:g}); 0 or less: constant")
    p.add_argument("--sft-steps", type=int, default=None, help="warm-start SFT steps (default: the recipe's)")
    p.add_argument("--model", default=None,
                   help="start from this model folder instead of the warm start; `smollm2`: SmolLM2-135M-Instruct "
                        "with --task arith (demo/smol.py; --sft-steps 0: untouched, --max-steps 0: no RL)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the trainer")
    p.add_argument("--max-steps", type=int, default=None,
                   help="RL budget in steps (the lr schedule decays over it); --minutes still caps the time")
    p.add_argument("--warm-start-precision", choices=("auto", "bf16", "fp32"), default=d.warm_start_precision,
                   help="warm-start SFT precision (auto: bf16 only where the CPU computes it natively and faster)")
    p.add_argument("--warm-start-turn", choices=DEMO_TURNS, default=d.warm_start_turn,
                   help="the turn each SFT demonstration ends on: any (along the secret's path) or found (where "
                        f"bisection finds it: every context of the tree equally often; default {d.warm_start_turn})")
    p.add_argument("--warm-start-habit", type=probability, default=d.warm_start_habit, metavar="P",
                   help="share of the SFT's 3-number ranges demonstrated with their lowest number: a systematic "
                        f"error greedy decoding keeps above ~0.4 (default {d.warm_start_habit:g}; 0: none)")
    p.add_argument("--warm-start-rounds", type=positive, default=d.warm_start_rounds, metavar="N",
                   help="runs of the SFT schedule at most: another from where one ended while the greedy last "
                        f"guess is wrong at a leaf of the bisection tree (default {d.warm_start_rounds})")
    p.add_argument("--sit-out-uniform", type=probability, default=d.sit_out_uniform, metavar="P",
                   help="chance that a task whose last group came back uniform (no signal) sits out its next "
                        "turn (default %(default)g; acts from the second epoch over the train tasks)")
    p.add_argument("--rl-precision", choices=("fp32", "bf16", "bf16-autocast", "auto"), default=d.rl_precision,
                   help="the RL engine's precision (default fp32, as the recipes were tuned; bf16 keeps fp32 master "
                        "weights and is the fastest where the CPU computes bf16 natively; auto: bf16 there, else fp32)")
    p.add_argument("--publish-pause", choices=get_args(PauseMode), default=d.publish_pause,
                   help="during each weight swap, requests in flight finish on the old weights first (wait, the "
                        "default) or are kept and go on with the new ones (keep: the swap waits for none)")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy evaluations")
    p.add_argument("--train-temperature", type=temperature, default=d.train_temperature, metavar="T",
                   help="the RL rollouts' sampling temperature (default %(default)g; the evaluations run at 1 "
                        "and greedy): below 1, training samples nearer what a greedy agent does")
    p.add_argument("--rewards", default=None, metavar="FILE",
                   help="guess and bfcl tasks: score every rollout under this reward configuration "
                        "(TOML/JSON, docs/rewards.md; examples/rewards/) and train on its final reward; the "
                        "evaluation stays the task's own success (bfcl: the configuration keeps a `bfcl` rule, "
                        "as examples/rewards/bfcl-stages.toml)")
    p.add_argument("--judge", choices=("smollm2",), default=None,
                   help="serve the --rewards configuration's judge ([rank_judge] or [reward_model] url on this "
                        "machine) with SmolLM2-135M-Instruct on a second vLLM CPU server (demo/judge.py)")
    p.add_argument("--task", type=task_name, default=d.task, metavar="TASK",
                   help="guess: one agent; team: two LangGraph agents (scout, closer), each its own LoRA policy; "
                        "arith: word problems with a calculator (--model smollm2); bfcl: SmolLM2 on BFCL function "
                        "calling, scored by BFCL's checker (demo/smol_bfcl.py); rg:NAME?KEY=VALUE: SmolLM2 on a "
                        "reasoning-gym dataset, scored by its own score_answer (demo/smol_rg.py)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="--model smollm2: train a LoRA adapter of this rank (0: the whole model)")
    p.add_argument("--shared-policy", action="store_true",
                   help="team: one LoRA policy for both agents (the comparison for separate policies)")
    p.set_defaults(func=run_cli)

    c = sub.add_parser("demo-compare", help="plot the reward curves of several demo runs in one image")
    c.add_argument("runs", nargs="+", help="LABEL=DIR (a demo output dir with results.json)")
    c.add_argument("--out", required=True)
    c.set_defaults(func=compare_cli)


def config_from(args: argparse.Namespace) -> DemoConfig:
    """The run's configuration from the command line (the task decides the lr defaults)."""
    mode = "sync" if args.sync else "async"
    d = DemoConfig()
    base: dict[str, Any] = {k: getattr(d, k) for k in ARITH_RECIPE}  # the settings a task may change
    if args.task == "team":
        base.update(lr=TEAM_LR[0], lr_end=TEAM_LR[1])
    elif args.task == "arith":
        base.update(ARITH_RECIPE)
    elif args.task == "bfcl":
        base.update(BFCL_RECIPE)
    elif args.task.startswith("rg:"):
        base.update(RG_RECIPE)
    given = {k: getattr(args, k) for k in ARITH_RECIPE if getattr(args, k) is not None}
    r = {**base, **given}
    if "lr_end" in given:  # 0 or less on the command line: a constant lr
        r["lr_end"] = given["lr_end"] if given["lr_end"] > 0 else None
    smol = is_smol(args.task)  # SmolDemoRun picks its own model
    label = "rg-" + args.task[3:].split("?")[0] if args.task.startswith("rg:") else args.task
    default_out = f"runs/demo-{args.seed}-{mode}" if args.task == "guess" else \
        f"runs/demo-smol-{label}-{args.seed}" if smol else \
        f"runs/demo-team-{'shared' if args.shared_policy else 'separate'}-{args.seed}"
    return DemoConfig(out_dir=args.out or default_out, seed=args.seed, minutes=r["minutes"],
                      task=args.task, shared_policy=args.shared_policy,
                      warm_start_seed=args.warm_start_seed,
                      mode=mode, eval_tasks=r["eval_tasks"], groups_per_step=r["groups_per_step"],
                      group_size=r["group_size"], groups_in_flight=r["groups_in_flight"],
                      max_staleness=args.max_staleness, lr=r["lr"],
                      dual_clip=args.dual_clip if args.dual_clip and args.dual_clip > 0 else None, algo=args.algo,
                      lr_end=r["lr_end"], lr_warmup_steps=max(0, r["lr_warmup_steps"]),
                      sft_steps=args.sft_steps, warm_start_precision=args.warm_start_precision,
                      warm_start_turn=args.warm_start_turn, warm_start_habit=args.warm_start_habit,
                      warm_start_rounds=args.warm_start_rounds,
                      rl_precision=args.rl_precision, sit_out_uniform=args.sit_out_uniform,
                      publish_pause=args.publish_pause,
                      threads=args.threads, model_dir=None if smol else args.model,
                      max_steps=args.max_steps, greedy=not args.no_greedy, rewards=args.rewards,
                      train_temperature=args.train_temperature,
                      extra={**({"lora_rank": args.lora_rank} if smol and args.lora_rank > 0 else {}),
                             **({"rg": args.task} if args.task.startswith("rg:") else {})},
                      progress=sys.stderr.isatty() or os.environ.get("LIGHTNING_PROGRESS") == "1")


def run_cli(args: argparse.Namespace) -> int:
    if args.shared_policy and args.task != "team":
        print("lightning-mw demo: --shared-policy is for --task team", file=sys.stderr)
        return 2
    if args.rewards and args.task not in ("guess", "bfcl"):
        print("lightning-mw demo: --rewards is for --task guess and bfcl (the team, arith and rg tasks evaluate "
              "by their own rewards)", file=sys.stderr)
        return 2
    if args.rewards and args.task == "bfcl" and (problem := _bfcl_rewards_problem(args.rewards)):
        print(f"lightning-mw demo: {problem}", file=sys.stderr)
        return 2
    if args.judge and (problem := _judge_problem(args)):
        print(f"lightning-mw demo: {problem}", file=sys.stderr)
        return 2
    smol = is_smol(args.task)
    if args.task == "arith" and args.model != "smollm2" or not smol and args.model == "smollm2" \
            or smol and args.task != "arith" and args.model not in (None, "smollm2"):
        print("lightning-mw demo: --task arith goes with --model smollm2, --task bfcl and rg:NAME run SmolLM2 "
              "(and smollm2 runs arith, bfcl or rg:NAME)", file=sys.stderr)
        return 2
    cfg = config_from(args)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    for name in ("httpx", "httpx2", "openai", "lightning_middleware.controller", "lightning_middleware.rows",
                 "trainer_backend.daemon", "trainer_backend.engines", "trainer_backend.serving",
                 "lightning_middleware.rewards"):
        logging.getLogger(name).setLevel(logging.WARNING)
    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if cfg.task == "bfcl":
            from trainer_backend.demo.smol_bfcl import BfclDemoRun

            run_demo(cfg, BfclDemoRun)
        elif cfg.task.startswith("rg:"):
            from trainer_backend.demo.smol_rg import ReasoningDemoRun

            run_demo(cfg, ReasoningDemoRun)
        elif smol:
            from trainer_backend.demo.smol import SmolDemoRun

            run_demo(cfg, SmolDemoRun)
        elif args.judge:
            from trainer_backend.demo.judge import JudgedDemoRun

            run_demo(cfg, JudgedDemoRun)
        elif cfg.task == "team":
            from trainer_backend.demo.team import TeamDemoRun

            run_demo(cfg, TeamDemoRun)
        else:
            run_demo(cfg)
    except KeyboardInterrupt:
        print("\nstopped (server, trainer and rollouts shut down)", flush=True)
        return 130
    return 0


def _bfcl_rewards_problem(path: str) -> str | None:
    """Why `path` cannot train a BFCL run (checked before the warm start), or None."""
    from lightning_middleware.rewards import ConfigError, load_config
    from trainer_backend.demo.smol_bfcl import rewards_problem

    try:
        config = load_config(path)
    except ConfigError as e:
        return str(e)
    return rewards_problem(config, path)


def _judge_problem(args: argparse.Namespace) -> str | None:
    """Why --judge cannot serve this run's judge (checked before the warm start), or None."""
    from lightning_middleware.rewards import ConfigError, load_config
    from trainer_backend.demo.judge import JudgeConfigError, judge_address

    try:
        judge_address(load_config(args.rewards) if args.rewards else None)
    except (ConfigError, JudgeConfigError) as e:
        return str(e)
    return None


def compare_cli(args: argparse.Namespace) -> int:
    runs = []
    for spec in args.runs:
        label, _, d = spec.partition("=")
        runs.append((label, json.loads((Path(d) / "results.json").read_text())))
    print(plot_curve(runs, args.out))
    return 0


if __name__ == "__main__":  # python -m trainer_backend.demo.cli ... == lightning-mw demo ...
    from lightning_middleware.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
