"""`lightning-mw demo`: train a small LangChain tool agent with RL on CPU, end to end.

The whole middleware path, for real:

    vLLM CPU server  <-HTTP-  LangChain agent (ChatOpenAI, wrapped by one line)
         ^                         | wrap() records token IDs + logprobs
         | hot swap                v
    TrainerDaemon  <-poll-  SQLite trace store  <-  RolloutController (continuous)

`DemoRun` does it in five steps, one method each:

1. `warm_start`: a ~1M-parameter Qwen2-style model and a BPE tokenizer built locally, then a
   short SFT on bisection episodes (cached under $LIGHTNING_HOME/demo),
2. `serve`: the vLLM CPU server on it, the controller that runs the agent,
3. `evaluate`: held-out tasks, sampled at temperature 1 (and greedy),
4. `train`: RL for a time (or step) budget: the controller keeps rollout groups running
   (async: while the trainer updates; sync: generate a batch, train, swap, repeat); the
   trainer daemon claims groups from the store, does a rollout-level GRPO step and publishes
   the weights into the running server,
5. `report`: the same evaluation again, OUT/results.json and OUT/reward_curve.png.

`TrainingLoop` is step 4: async (the default), the controller keeps rollout groups running while
the trainer daemon updates, bounded by back-pressure; sync: sample a batch, train, swap, repeat.
Each step adds one point to the curve (OUT/results.json). The lr warms up by step, then decays by
the share of the RL budget spent (`lr_at`, `spent`).

Ctrl-C stops everything (controller, trainer, server).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_middleware.controller import RolloutController, RolloutResult
from lightning_middleware.rewards import RewardConfig, Scorer, load_config
from lightning_middleware.store import TraceStore
from trainer_backend.algorithms.registry import get
from trainer_backend.caching import lightning_home
from trainer_backend.daemon.config import GroupPolicy, StepResult, TrainerConfig
from trainer_backend.daemon.reward_gate import RewardPolicy
from trainer_backend.daemon.trainer_daemon import TrainerDaemon
from trainer_backend.demo.agent import SERVED_NAME, evaluate, make_agent, secrets_line
from trainer_backend.demo.outcomes import curve_summary, report_line, step_outcomes
from trainer_backend.demo.report import plot_curve
from trainer_backend.demo.sft import idle_cores
from trainer_backend.demo.task import make_tasks
from trainer_backend.demo.warm_start import WarmStartConfig, warm_start
from trainer_backend.serving.env import ensure_vllm_env
from trainer_backend.serving.publisher import PauseMode, WeightPublisher
from trainer_backend.serving.server import VLLMServer

if TYPE_CHECKING:  # torch is imported when training starts
    from trainer_backend.algorithms.losses import LossConfig
    from trainer_backend.engines.policies import PolicySet
    from trainer_backend.engines.torch_config import TorchEngineConfig
    from trainer_backend.engines.torch_engine import TorchEngine

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    out_dir: str = "runs/demo"
    task: str = "guess"  # guess | team (demo/team.py: two LangGraph agents, a LoRA policy each) | arith (smol.py)
    shared_policy: bool = False  # team: one adapter for both roles, for comparison
    seed: int = 0  # RL: train/eval task draws (vLLM sampling itself is not seeded, see make_agent)
    warm_start_seed: int = 0  # the warm start (tokenizer, init, SFT order); shared by RL seeds, cached
    minutes: float = 10.0  # RL wall-clock budget (evaluations and startup not included); a cap with max_steps
    mode: str = "async"  # async | sync
    eval_tasks: int = 256
    train_tasks: int = 4096
    group_size: int = 8
    groups_per_step: int = 8
    groups_in_flight: int = 16  # async: groups kept running while the trainer updates
    sit_out_uniform: float = 0.0  # async: chance a task whose last group was uniform sits out its next turn
    max_staleness: int = 2
    lr: float = 3e-4  # peak: higher peaks were unstable in async mode (docs/demo.md)
    lr_end: float | None = 1e-4  # linear decay from lr to lr_end over the RL budget; None: constant
    lr_warmup_steps: int = 10  # Adam's first steps move every weight by ~lr: start small
    clip: float = 0.2
    algo: str = "grpo"  # one of trainer_backend/algorithms/registry.py's ALGORITHMS
    dual_clip: float | None = 3.0  # c > 1: bound -A*ratio at -A*c for A < 0 (stale rollouts' large ratios)
    sft_steps: int | None = None  # None: WarmStartConfig's default
    warm_start_precision: str = "auto"  # bf16 autocast where native and faster, else fp32
    warm_start_turn: str = WarmStartConfig.demo_turn  # the turn each SFT demonstration ends on
    warm_start_habit: float = WarmStartConfig.habit  # share of 3-number ranges demonstrated with their lowest
    warm_start_rounds: int = WarmStartConfig.max_rounds  # runs of the SFT schedule while a leaf is read wrong
    # RL's engine precision (TorchEngineConfig.precision): fp32 by default, as the recipes were tuned;
    # "bf16" (fp32 master weights) trains SmolLM2 2.3x faster on AMX (docs/benchmarks.md)
    rl_precision: str = "fp32"
    # during a weight swap, requests in flight finish on the old weights first ("wait") or go on with
    # the new ones ("keep"; serving/publisher.py)
    publish_pause: PauseMode = "wait"
    model_dir: str | None = None  # start from this HF folder instead of the cached warm start
    greedy: bool = True  # also evaluate greedily
    # the RL rollouts' sampling temperature (the evaluations keep T=1 and greedy); the trainer scores
    # each token at its call's temperature, so the PPO ratio stays against what vLLM sampled
    train_temperature: float = 1.0
    concurrency: int = 128
    threads: int | None = None  # torch threads in the trainer (None: 1 in async mode, all cores in sync)
    max_steps: int | None = None  # RL budget in steps (the lr decays over it); `minutes` still caps the time
    rewards: str | None = None  # a reward configuration file (docs/rewards.md) every rollout is scored under
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- the lr schedule over the RL budget


def lr_at(cfg: DemoConfig, step: int, spent: float) -> float:
    """The learning rate of RL step `step` (1-based) with `spent` of the budget used.

    Linear warm-up over the first `lr_warmup_steps` steps (Adam's first updates move every
    weight by ~lr, whatever the gradient's size), then a linear decay by the share of the
    budget spent, to `lr_end` at its end.
    """
    if step <= cfg.lr_warmup_steps:
        return cfg.lr * step / cfg.lr_warmup_steps
    if cfg.lr_end is None:
        return cfg.lr
    return cfg.lr + (cfg.lr_end - cfg.lr) * min(1.0, max(0.0, spent))


def spent(cfg: DemoConfig, step: int, elapsed_s: float) -> float:
    """Share of the RL budget used after `step` steps and `elapsed_s` seconds: the larger of the
    time share and, with max_steps, the step share (a step budget ends where the time cap would)."""
    share = elapsed_s / (cfg.minutes * 60)
    if cfg.max_steps:
        share = max(share, step / cfg.max_steps)
    return share


def run_demo(cfg: DemoConfig, run_class: type[DemoRun] | None = None,
             after_train: Callable[[DemoRun], None] | None = None) -> dict[str, Any]:
    """Warm start, serve, evaluate, train, evaluate again. Returns the results (also written to
    OUT/results.json, with OUT/reward_curve.png). `run_class`: a DemoRun with other steps (the team task).
    `after_train(run)` is called once RL has ended, with the trained policy still served."""
    if cfg.mode not in ("async", "sync"):
        raise ValueError(f"mode must be async or sync, not {cfg.mode!r}")
    run = (run_class or DemoRun)(cfg)
    try:
        run.warm_start()
        run.serve()
        run.server_threads("before", idle_cores(1.0))
        run.results["before"] = run.evaluate("before")
        run.train()
        run.server_threads("after", idle_cores(1.0))  # the trainer is done
        if after_train is not None:
            after_train(run)
        run.results["after"] = run.evaluate("after")
        return run.report()
    finally:
        run.close()


class DemoRun:
    """One demo run's state; the steps are called in order by `run_demo`."""

    rollout_timeout_s: float | None = 120.0  # the controller's per-episode hang guard

    def __init__(self, cfg: DemoConfig) -> None:
        from trainer_backend.engines.precision import describe_machine

        self.cfg = cfg
        self.out = Path(cfg.out_dir).resolve()
        self.timings: dict[str, float] = {}
        self.t_all = time.perf_counter()
        self.results: dict[str, Any] = {"config": asdict(cfg), "machine": describe_machine()}
        self.eval_tasks = make_tasks(cfg.eval_tasks, cfg.seed, "eval")
        self.train_tasks = make_tasks(cfg.train_tasks, cfg.seed, "train")
        self.model_dir = Path(cfg.model_dir) if cfg.model_dir else None
        # Loaded, and every function resolved (Scorer), before anything starts: a bad file fails fast.
        self.reward_config: RewardConfig | None = load_config(cfg.rewards) if cfg.rewards else None
        if self.reward_config is not None:
            Scorer(self.reward_config)
            self.results["rewards"] = {"path": str(Path(cfg.rewards or "").resolve()), "hash": self.reward_config.hash,
                                       "name": self.reward_config.name, "config": self.reward_config.describe()}
        self.store: TraceStore | None = None
        self.server: VLLMServer | None = None
        self.controller: RolloutController | None = None
        self.daemon: TrainerDaemon | None = None
        self._threads: list[threading.Thread] = []
        self._timer: threading.Timer | None = None
        self._threads_before: int | None = None

    # -- 1. warm start ----------------------------------------------------------------
    def warm_start(self) -> None:
        cfg = self.cfg
        ws = WarmStartConfig(seed=cfg.warm_start_seed, precision=cfg.warm_start_precision,
                             sft_steps=cfg.sft_steps or WarmStartConfig.sft_steps,
                             demo_turn=cfg.warm_start_turn, habit=cfg.warm_start_habit,
                             max_rounds=cfg.warm_start_rounds).resolved()
        self.results["warm_start"] = asdict(ws)
        say(f"[1/5] warm start (cached under {lightning_home() / 'demo'})")
        say(f"      SFT in {ws.precision} ({'native bf16' if ws.precision == 'bf16' else 'no fast bf16 on this CPU'})")
        t0 = time.perf_counter()
        if self.model_dir is None:
            self.model_dir = warm_start(lightning_home() / "demo" / f"warmstart-{ws.key()}", ws, progress=cfg.progress)
        record = self.model_dir / "warm_start.json"  # a --model folder may be a warm start too
        kept = json.loads(record.read_text()) if record.exists() else {}
        if "leaves_right" in kept:  # builds since 2026-12-07 read their own last guesses
            self.results["warm_start"]["leaves_right"] = kept["leaves_right"]
            rounds = len(kept.get("leaves_right_by_round", [])) or 1
            say(f"      greedy last guess right at {kept['leaves_right']} of {len(kept['last_guesses'])} "
                "leaves of the bisection tree" + (f" after {rounds} runs of the SFT schedule" if rounds > 1 else ""))
        self.timings["warm_start_s"] = time.perf_counter() - t0
        self.results["model_dir"] = str(self.model_dir)

    # -- 2. serve ----------------------------------------------------------------------
    def serve(self) -> None:
        assert self.model_dir is not None
        if self.out.exists():  # a rerun starts a fresh store and checkpoints; the warm start is reused
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        store = self.store = TraceStore(f"sqlite:///{self.out / 'traces.db'}")
        say("[2/5] starting the vLLM CPU server")
        ensure_vllm_env()
        t0 = time.perf_counter()
        self.server = self._server().start()
        self.timings["server_start_s"] = time.perf_counter() - t0
        self.controller = RolloutController(
            self._agent(self.server.base_url, store), store=store, backend="asyncio",
            concurrency=self.cfg.concurrency, timeout_s=self.rollout_timeout_s,
            policy_version=lambda: store.latest_policy_version() or 0,
            policy_version_ttl_s=0.0,  # sync mode must never tag a stale version
            rewards=self.reward_config)  # None: the agent's own reward trains
        if self.reward_config is not None:
            source = self.cfg.rewards or "the task's own configuration"
            say(f"      reward: {source} (hash {self.reward_config.hash}): "
                + ", ".join(f"{n} x {w:g}" for n, w in self.reward_config.weights.items()))

    def server_threads(self, phase: str, threads: int) -> None:
        """How many threads the server's model computes on from `phase` on. It is bound to every
        core (`all_cores`); an evaluation takes the cores other processes leave idle (the demo's own
        trainer is not running then), async RL those its trainer leaves. On 2 AVX2 cores a BFCL
        evaluation ran 1.56x faster on both than on vLLM's default of one, and 0.77x as fast on both
        beside a busy process (OpenMP threads wait on each other), so a core is taken only while
        idle (docs/benchmarks.md)."""
        if self.server is not None and self.server.all_cores and self.server.device == "cpu":
            got = self.server.set_threads(threads)
            self.results.setdefault("server_threads", {})[phase] = got
            log.info("the vLLM server's model computes on %d thread(s) for %s", got, phase)

    def _server(self) -> VLLMServer:
        assert self.model_dir is not None
        return VLLMServer(self.model_dir, dtype="float32", served_model_name=SERVED_NAME, max_model_len=1024,
                          log_path=self.out / "vllm.log", extra_args=["--max-num-seqs", "256"], all_cores=True)

    def _agent(self, base_url: str, store: TraceStore) -> Any:
        return make_agent(base_url, store)

    # -- 3. evaluate -------------------------------------------------------------------
    def evaluate(self, tag: str) -> dict[str, Any]:
        assert self.controller is not None
        step = "[3/5] baseline" if tag == "before" else "[5/5] after RL: evaluating"
        say(f"{step} on {len(self.eval_tasks)} held-out tasks")
        res = {"sampled": evaluate(self.controller, self.eval_tasks, temperature=1.0, tag=f"{tag}-t1",
                                   store=self.store)}
        if self.cfg.greedy:
            res["greedy"] = evaluate(self.controller, self.eval_tasks, temperature=0.0, tag=f"{tag}-greedy",
                                     store=self.store)
        sampled = res["sampled"]
        say(f"      success {sampled['success']:.1%} sampled (T=1)"
            + (f", {res['greedy']['success']:.1%} greedy" if self.cfg.greedy else "")
            + f"; {sampled.get('tool_calls_mean', float('nan')):.2f} tool calls per rollout"
            + (f", hacking rate {sampled['hacking_rate']:.1%}" if "hacking_rate" in sampled else ""))
        return res

    # -- 4. train ----------------------------------------------------------------------
    def train(self) -> None:
        import torch

        cfg, store, controller = self.cfg, self.store, self.controller
        assert store is not None and controller is not None and self.server is not None and self.model_dir
        # async: one trainer thread, the other core samples; sync: vLLM idles while the trainer
        # runs, so torch's default (all cores). As measured in docs/benchmarks.md.
        self._threads_before = torch.get_num_threads()  # given back by close(): the process may go on
        torch.set_num_threads(cfg.threads or (1 if cfg.mode == "async" else (os.cpu_count() or 1)))
        if cfg.mode == "async":  # vLLM samples on the cores the trainer leaves; sync: they take turns
            self.server_threads("rl", max(1, len(os.sched_getaffinity(0)) - torch.get_num_threads()))
        engine = self._engine(self._engine_config())
        daemon = self.daemon = TrainerDaemon(
            store, engine,
            TrainerConfig(checkpoint_dir=str(self.out / "checkpoints"), mode=cfg.mode, max_staleness=cfg.max_staleness,
                          algorithm=cfg.algo,
                          group=GroupPolicy(group_size=cfg.group_size, groups_per_step=cfg.groups_per_step,
                                            group_timeout_s=600, skip_uniform=cfg.algo != "ppo"),
                          rewards=self.reward_policy()),
            self._publisher())
        budget = f" or {cfg.max_steps} steps" if cfg.max_steps else ""
        say(f"[4/5] RL for {cfg.minutes:g} min{budget} ({cfg.mode}, {cfg.algo})"
            + f": {cfg.groups_per_step} tasks x {cfg.group_size} samples per step, lr {cfg.lr:g} "
            f"(warm-up {cfg.lr_warmup_steps} steps" + (f", then to {cfg.lr_end:g} by the end)" if cfg.lr_end is not None
                                                       else ")"))
        # the guess task's success, tool calls and guards read back from the store (outcomes.py)
        loop = TrainingLoop(cfg, controller, daemon, engine, store if cfg.task == "guess" else None)
        self._timer = threading.Timer(cfg.minutes * 60, loop.stop)
        self._timer.daemon = True
        self._timer.start()
        t_rl = time.perf_counter()
        if cfg.mode == "async":
            self._threads = loop.run_async(self.rl_tasks())
        else:
            loop.run_sync(self.rl_tasks())
        self.timings["rl_s"] = time.perf_counter() - t_rl
        controller.resume()  # the evaluation after RL runs through the same controller
        curve = loop.curve
        self.results.update(curve=curve, steps=len(curve), trained_rollouts=int(sum(c["rollouts"] for c in curve)),
                            skipped_total=dict(daemon.skipped_total))

    def rl_tasks(self) -> list[dict[str, Any]]:
        """The train tasks as RL samples them: at the run's training temperature."""
        return [dict(t, temperature=self.cfg.train_temperature) for t in self.train_tasks]

    def reward_policy(self) -> RewardPolicy:
        """A ranking judge ranks whole groups, so the trainer scores them (docs/rewards.md):
        without the configuration it would hold every group pending forever."""
        judged = self.reward_config is not None and self.reward_config.rank_judge is not None
        return RewardPolicy(config=self.reward_config) if judged else RewardPolicy()

    def _engine_config(self) -> TorchEngineConfig:
        """fp32 unless asked (`rl_precision`): the recipes were tuned in fp32, and RL's probability
        ratios compare against vLLM's fp32 log-probs."""
        from trainer_backend.algorithms.losses import LossConfig
        from trainer_backend.engines.torch_config import TorchEngineConfig

        cfg = self.cfg
        return TorchEngineConfig(
            lr=lr_at(cfg, 1, 0.0), freeze_embeddings=True, precision=cfg.rl_precision,
            loss=_loss_of(cfg.algo, LossConfig(clip_low=cfg.clip, clip_high=cfg.clip, dual_clip_c=cfg.dual_clip)),
            **_extras_of(cfg))

    def _engine(self, config: TorchEngineConfig) -> TorchEngine | PolicySet:
        """The training engine: the whole model here (the team task: a set of LoRA policies)."""
        from trainer_backend.engines.torch_engine import TorchEngine

        assert self.model_dir is not None
        return TorchEngine(self.model_dir, config)

    def _publisher(self) -> WeightPublisher:
        assert self.server is not None
        return WeightPublisher(self.server.url, pause=self.cfg.publish_pause)

    # -- 5. report ---------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        import json

        res = self.results
        self.timings["total_s"] = time.perf_counter() - self.t_all
        res["timings"] = self.timings
        res["load_avg"] = os.getloadavg()
        before, after = res["before"], res["after"]
        gain = after["sampled"]["success"] - before["sampled"]["success"]
        res["gain_pp"] = 100 * gain
        res["rl_summary"] = curve_summary(res.get("curve", []))
        (self.out / "results.json").write_text(json.dumps(res, indent=2, default=str))
        plot_curve(res, self.out / "reward_curve.png")
        say(f"\nheld-out success, sampled (T=1): {before['sampled']['success']:.1%} -> "
            f"{after['sampled']['success']:.1%} ({100 * gain:+.1f} pp)")
        if "greedy" in before:
            say(f"held-out success, greedy:        {before['greedy']['success']:.1%} -> "
                f"{after['greedy']['success']:.1%}")
            if "secrets" in before["greedy"]:
                say(secrets_line(before["greedy"]["secrets"], after["greedy"]["secrets"]))
        if line := report_line(res):
            say(line)
        say(f"{res['steps']} steps, {res['trained_rollouts']} rollouts trained in {self.timings['rl_s'] / 60:.1f} min; "
            f"curve: {self.out / 'reward_curve.png'}")
        return res

    def close(self) -> None:
        """Stop everything that runs; a second Ctrl-C meanwhile must not skip the cleanup."""
        main = threading.current_thread() is threading.main_thread()
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            if self._timer is not None:
                self._timer.cancel()
            if self.daemon is not None:
                self.daemon.close()
            if self.controller is not None:
                self.controller.stop()
                for t in self._threads:
                    t.join(timeout=30)
                self.controller.close()
            if self.server is not None:
                self.server.stop()
            if self.store is not None:
                self.store.close()
            if self._threads_before is not None:
                import torch

                torch.set_num_threads(self._threads_before)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


class TrainingLoop:
    """The RL phase: rollouts and trainer steps, the lr schedule, the curve, the budget."""

    def __init__(self, cfg: DemoConfig, controller: RolloutController, daemon: TrainerDaemon,
                 engine: TorchEngine | PolicySet, store: TraceStore | None = None) -> None:
        self.cfg, self.controller, self.daemon, self.engine = cfg, controller, daemon, engine
        self.store = store  # None: success from the results' rewards (the team and arith tasks)
        self.stopping = threading.Event()
        self.curve: list[dict[str, Any]] = []
        # Success over ALL train rollouts that finished since the previous step: the trained
        # batch alone is biased (groups whose rewards are all equal carry no signal and are skipped).
        self.finished: list[RolloutResult] = []
        self.seen = 0
        self.trained = 0
        self.t0 = time.perf_counter()
        self.bar = _progress(cfg)

    def stop(self) -> None:
        """The budget is spent: no new rollout groups (the back-pressure thread ends with the
        flag; without this the controller would run free while the trainer finishes its step)."""
        self.stopping.set()
        self.controller.stop()
        self.daemon.stop()

    def on_group(self, group: list[RolloutResult]) -> None:
        self.finished.extend(group)

    def on_step(self, res: StepResult) -> None:
        m, cfg = res.metrics, self.cfg
        lr_used = self.engine.lr
        # the next step's learning rate
        self.engine.set_lr(lr_at(cfg, res.step + 1, spent(cfg, res.step, time.perf_counter() - self.t0)))
        self.trained += int(m.get("n_rollouts", 0))
        new, self.seen = self.finished[self.seen:], len(self.finished)
        found = step_outcomes(self.store, new)
        success = found.pop("success", float("nan"))
        self.curve.append({
            "step": res.step, "t_s": time.perf_counter() - self.t0, "version": res.policy_version,
            "success": success, "finished": len(new), "batch_reward": m["reward_mean"],
            # the finished rollouts' tool calls and guards; the trained batch's as the trainer logged them
            **found, **{f"batch_{k}": v for k, v in m.items() if k == "hacking_rate" or k.startswith("guard_")},
            "batch_success": m["success_rate"], "rollouts": m.get("n_rollouts", 0), "kl": m.get("approx_kl"),
            "lr": lr_used, "clip_frac": m.get("clip_frac"), "step_time_s": m.get("step_time_s"),
            "staleness_max": m.get("staleness_max"), "entropy": m.get("entropy"), "grad_norm": m.get("grad_norm"),
            "ratio_max": m.get("ratio_max"), "clip_frac_lower": m.get("clip_frac_lower"),
            **{k: v for k, v in m.items() if k.startswith(("skipped_", "rows_", "rank_judge_", "reward_judge"))},
            # separate policies (the team task): each policy's share of the step
            **{k: v for k, v in m.items() if k.endswith(("/rows", "/loss", "/updates", "/grad_norm"))}})
        if self.bar is not None:
            recent = [c["success"] for c in self.curve[-5:] if c["success"] == c["success"]]
            self.bar.n = min(int(self.curve[-1]["t_s"]), int(cfg.minutes * 60))
            self.bar.set_postfix_str(f"step {res.step}  reward {success:.2f}  "
                                     f"avg5 {sum(recent) / max(1, len(recent)):.2f}  kl {m.get('approx_kl', 0.0):.3f}")
            self.bar.refresh()
        if cfg.max_steps is not None and res.step >= cfg.max_steps:
            self.stop()

    def run_async(self, tasks: list[dict[str, Any]]) -> list[threading.Thread]:
        """Rollouts keep running while the trainer updates; returns the threads to join."""
        cfg = self.cfg
        rollouts = self.controller.start_continuous(tasks, n=cfg.group_size, groups_in_flight=cfg.groups_in_flight,
                                                    on_group=self.on_group, sit_out_uniform=cfg.sit_out_uniform,
                                                    seed=cfg.seed)
        bp = threading.Thread(target=self._backpressure, daemon=True, name="demo-backpressure")
        bp.start()
        self.daemon.run(on_step=self.on_step)
        self.stopping.set()
        self.controller.stop()
        self._close_bar()
        rollouts.join(timeout=120)
        bp.join(timeout=5)
        return [rollouts, bp]

    def _backpressure(self) -> None:
        """Bounded staleness by back-pressure: at most `max_staleness` batches of train rollouts
        running or finished and not yet trained/skipped by the daemon. Without it the generator
        (2x faster than the trainer here) fills the pool with rollouts that go stale and are
        dropped, and takes the CPU the trainer needs."""
        cfg, controller = self.cfg, self.controller
        ahead = cfg.max_staleness * cfg.groups_per_step * cfg.group_size
        while not self.stopping.is_set():
            taken = self.trained + sum(self.daemon.skipped_total.values())
            outstanding = controller.in_flight + len(self.finished) - taken
            if outstanding >= ahead and not controller.paused:
                controller.pause()
            elif outstanding < ahead and controller.paused:
                controller.resume()
            self.stopping.wait(0.1)
        controller.resume()

    def run_sync(self, tasks: list[dict[str, Any]]) -> None:
        """Sample a batch with the current weights, train, swap, repeat (no overlap). Groups with
        no signal (all rewards equal) are skipped by the daemon; only that many are sampled again."""
        cfg, i, need = self.cfg, 0, self.cfg.groups_per_step
        while not self.stopping.is_set():
            batch = [tasks[(i + k) % len(tasks)] for k in range(need)]
            i += need
            self.on_group(self.controller.run(batch, n=cfg.group_size))
            if self.stopping.is_set():
                break
            skipped_before = sum(self.daemon.skipped_total.values())
            res = self.daemon.step_once()
            if res is None:  # too few groups had signal
                lost = sum(self.daemon.skipped_total.values()) - skipped_before
                need = max(1, lost // cfg.group_size)
            else:
                need = cfg.groups_per_step
                self.on_step(res)
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.n = int(self.cfg.minutes * 60)
            self.bar.close()
            self.bar = None


def _progress(cfg: DemoConfig) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=int(cfg.minutes * 60), unit="s", desc="RL", dynamic_ncols=True,
                bar_format="{desc} {bar} {n_fmt}/{total_fmt}s {postfix}")


def _loss_of(algo: str, loss: LossConfig) -> LossConfig:
    """The algorithm's own ratio and aggregation (GSPO's sequence level); the others differ in their advantages."""
    a = get(algo)
    return replace(loss, ratio_level=a.ratio_level, agg=a.agg or loss.agg)


def _extras_of(cfg: DemoConfig) -> dict[str, Any]:
    """PPO's critic (the policy's lr, constant: the small model's value head learns at its pace)
    and DPO's beta; nothing for the outcome algorithms."""
    from trainer_backend.algorithms.advantages import CriticConfig
    from trainer_backend.algorithms.losses import DPOConfig

    if cfg.algo == "ppo":
        return {"critic": CriticConfig(lr=cfg.lr)}
    if cfg.algo == "dpo":
        return {"dpo": DPOConfig(beta=0.1)}
    return {}


def say(msg: str) -> None:
    """The demo's console output (a user-facing command, not a log)."""
    print(msg, flush=True)
