"""The demo's RL phase: rollouts and trainer steps, the lr schedule, the curve, the budget.

Async (the default): the controller keeps rollout groups running while the trainer daemon
updates, bounded by back-pressure; sync: sample a batch, train, swap, repeat. Each step adds one
point to the curve (OUT/results.json): the finished train rollouts' success, tool calls and
guards, and the trainer's metrics.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from lightning_middleware import TraceStore
from lightning_middleware.controller import RolloutController, RolloutResult
from trainer_backend.daemon.trainer_daemon import StepResult, TrainerDaemon
from trainer_backend.demo.outcomes import step_outcomes
from trainer_backend.demo.schedule import lr_at, spent

if TYPE_CHECKING:
    from trainer_backend.demo.run import DemoConfig
    from trainer_backend.engines.policies import PolicySet
    from trainer_backend.engines.torch_engine import TorchEngine


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
                                                    on_group=self.on_group)
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
