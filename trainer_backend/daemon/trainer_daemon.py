"""The trainer daemon: poll the store, build rollout-level GRPO batches, train, publish.

One loop, one step at a time:

    collect   finished train-mode rollouts nobody consumed, grouped by task id;
              a group is ready at `group_size` rollouts, or after `group_timeout_s`
              with at least `min_group_size`; groups with no signal (all rewards
              equal), rollouts without a reward, failed ones and stale ones are
              skipped -- each counted, none silently.
    claim     the chosen rollouts (a conditional UPDATE: two daemons on one
              database never get the same rollout).
    train     rows from their training calls (rows.py), rollout-level advantages
              (algorithms/advantages.py; the loss: losses.py), one engine step.
    publish   save an HF checkpoint, hot-swap it into the serving engine.
    commit    the step's metrics, the new policy version and "these rollouts are
              consumed" in ONE transaction.

Crash safety: a kill -9 anywhere before `commit` leaves the rollouts claimed but
not consumed; at start the daemon releases its own claims, reloads the latest
committed checkpoint and republishes it, so no rollout is trained twice into
the committed lineage and none is lost.

Modes: `async` keeps taking rollouts while agents run; a rollout whose policy
version lags the current one by more than `max_staleness` is dropped (or kept,
`stale="keep"`: the PPO ratio against vLLM's behaviour logprobs then corrects
it). `sync` takes only rollouts sampled by the current version.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import statistics
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning_middleware import PolicyVersion, Rollout, TraceStore, TrainStep
from lightning_middleware.records import Event
from lightning_middleware.rows import RowStats, build_rows_for_rollouts
from lightning_middleware.store import LeaseLost, StoreError, get_store
from trainer_backend.daemon.config import Batch, StepResult, TrainerConfig
from trainer_backend.daemon.drift import DriftWatch
from trainer_backend.daemon.monitoring import HealthChecks
from trainer_backend.daemon.reward_gate import RankAhead, RewardGate
from trainer_backend.daemon.validation import PeriodicEvaluation, protected_checkpoints
from trainer_backend.engines.base import Engine, Publisher, RoutesRows

log = logging.getLogger(__name__)


class TrainerDaemon:
    """Runs the loop above. Build the engine from `resume_point()` so a restart continues the lineage."""

    def __init__(self, store: TraceStore | str, engine: Engine, config: TrainerConfig,
                 publisher: Publisher | None = None, drift: DriftWatch | None = None) -> None:
        """`drift`: the per-step drift metrics, with a tokenizer to re-tokenise calls and the served
        template's check after each publish (default: prefix breaks only)."""
        self.store = get_store(store)
        self.engine = engine
        self.config = config
        self.publisher = publisher
        self.skipped_total: Counter[str] = Counter()
        self._skipped_since_step: Counter[str] = Counter()
        self._stop = threading.Event()
        self._closed = threading.Event()
        self.health = HealthChecks(config.health)
        self.drift = drift or DriftWatch(self.store, source=config.trainer_id)
        self.rewards = RewardGate(self.store, config.rewards, source=config.trainer_id)
        # torch comes with the advantages: imported here, so registering the CLI stays light
        from trainer_backend.algorithms.advantages import TurnCredit

        self.credit = TurnCredit(self.store, config.credit, config.credit_gamma)
        self.evaluation = (PeriodicEvaluation(config.eval, self.store, config.checkpoint_dir)
                           if config.eval is not None else None)
        # One live run per trainer id (refused otherwise): a second daemon of the same id would
        # release this one's claims and train them again. Taken before touching any claim.
        self.run_id = self.store.acquire_trainer(config.trainer_id, lease_s=config.lease_s)
        self._heartbeat = threading.Thread(target=_beat, args=(weakref.ref(self), self._closed, config.lease_s / 4),
                                           daemon=True, name=f"lease-{config.trainer_id}")
        self._heartbeat.start()
        self._step = self._last_step()
        released = self.store.release_claims(config.trainer_id)
        if released:
            log.warning("released %d rollouts claimed by an earlier run of %s that did not commit",
                        released, config.trainer_id)
        # A ranking judge ranks the next two steps' groups while this one trains (reward_gate.py).
        self._rank_ahead = (RankAhead(self.rewards, self._rankable_groups, 2 * config.group.groups_per_step,
                                      config.poll_interval_s, name=f"rank-ahead-{config.trainer_id}",
                                      newest_first=config.mode == "sync" or config.stale == "drop")
                            if self.rewards.ranks_groups and config.rewards.rank_ahead else None)

    # -- lifecycle -----------------------------------------------------------
    @staticmethod
    def resume_point(store: TraceStore | str, model_dir: str | Path, trainer_id: str = "trainer-0"
                     ) -> tuple[Path, int]:
        """(checkpoint to load, its policy version): this trainer's latest committed one, else the base model."""
        s = get_store(store)
        latest = s.latest_policy_version(trainer_id)
        if latest is not None:
            pv = s.get_policy_version(latest, trainer_id)
            if pv is not None and pv.path and Path(pv.path).is_dir():
                return Path(pv.path), latest
        return Path(model_dir), latest or 0

    @property
    def rank_ahead(self) -> RankAhead | None:
        """The thread that ranks ready groups ahead of the collect, where the rewards have a ranking judge."""
        return self._rank_ahead

    def _last_step(self) -> int:
        steps = [s.step for s in self.store.train_steps(self.config.trainer_id)]
        return max(steps, default=0)

    def stop(self) -> None:
        """Make `run()` return after the current step (the lease is kept: see `close`)."""
        self._stop.set()

    def close(self) -> None:
        """Stop, and hand the trainer id back so another daemon of that id may start at once."""
        self._stop.set()
        self._closed.set()
        if self._rank_ahead is not None:
            self._rank_ahead.close()
        self._heartbeat.join(timeout=5)
        if self.evaluation is not None:
            self.evaluation.close()
        try:
            self.store.release_trainer(self.config.trainer_id, self.run_id)
        except StoreError as exc:  # the store is down: the lease expires by itself
            log.warning("could not release the lease of %s: %s", self.config.trainer_id, exc)

    def __enter__(self) -> TrainerDaemon:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def run(self, *, max_steps: int | None = None, idle_timeout_s: float | None = None,
            on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
        """Train until stopped, `max_steps` steps, or `idle_timeout_s` without a batch."""
        results: list[StepResult] = []
        idle_since = time.monotonic()
        while not self._stop.is_set() and (max_steps is None or len(results) < max_steps):
            result = self.step_once()
            if result is None:
                if idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                    break
                self._stop.wait(self.config.poll_interval_s)
                continue
            idle_since = time.monotonic()
            results.append(result)
            if on_step is not None:
                on_step(result)
        return results

    # -- one step ------------------------------------------------------------
    def step_once(self) -> StepResult | None:
        batch = self.collect()
        if batch is None:
            return None
        return self.train(batch)

    def collect(self) -> Batch | None:
        """Claim the next batch, or None if not enough usable groups are ready yet."""
        g = self.config.group
        trainable: list[tuple[list[Rollout], list[Rollout]]] = []  # (group members, usable members)
        groups = self._drop_stale(self._ready_groups())
        # separate policies: the roles' own rewards are signal too (one query for every ready group)
        ids = [r.id for m in groups for r in m]
        per_agent = self.store.agent_rewards(ids) if g.skip_uniform and isinstance(self.engine, RoutesRows) else {}
        per_step = self.credit.step_rewards(ids) if g.skip_uniform else {}  # per-turn: steps are signal too
        for reviewed in self._reviewed(groups, trainable):  # a ranking judge ranks them concurrently
            if reviewed is None:  # a configured component is still to come: the group waits
                continue
            members = reviewed
            usable, reasons = self._filter(members)
            if g.skip_uniform and len({_reward_profile(r, per_agent, per_step) for r in usable}) == 1:
                reasons["uniform_reward"] += len(usable)
                usable = []
            if len(usable) < g.min_group_size:
                reasons["group_too_small"] += len(usable)
                usable = []
            if usable:
                trainable.append((members, usable))
            elif self._take(members):  # a group with no signal leaves the pool now, counted
                self._skip(members, reasons)
        if len(trainable) < g.groups_per_step:
            return None
        taken: list[Rollout] = []
        for members, usable in trainable[: g.groups_per_step]:
            if not self._take(members):
                continue
            _, reasons = self._filter(members)
            self._skip([r for r in members if r not in usable], reasons)
            taken.extend(usable)
        if len({r.task_id for r in taken}) < g.groups_per_step:  # lost groups to another daemon
            self.store.release_claims(self.config.trainer_id, [r.id for r in taken])
            return None
        skipped, self._skipped_since_step = dict(self._skipped_since_step), Counter()
        return Batch(rollouts=tuple(taken), skipped=skipped)

    def _reviewed(self, groups: list[list[Rollout]], trainable: Sequence[object]) -> Iterator[list[Rollout] | None]:
        """The ready groups as the reward gate gives them, oldest first. A ranking judge ranks
        them a chunk at a time until the step has its groups: with a backlog (rollouts faster
        than the trainer, or a trainer restarted on a full pool) ranking every ready group in one
        collect costs judge time in proportion to the backlog, for groups the step does not train.
        `trainable` is the caller's list of the groups found usable so far, read between chunks."""
        chunk = self.rewards.review_chunk
        if chunk is None:
            yield from self.rewards.review_groups(groups)
            return
        # A judge that ranks only tied groups, with a rank-ahead thread: a tied group waits for that
        # thread, so the collect asks the judge nothing and trains the groups the rules tell apart.
        # (At scope "all" every group needs the judge, and a collect ranking the groups the thread
        # has not reached adds to its concurrency.)
        defer = self._rank_ahead is not None and self.rewards.ranks_ties_only
        size = max(chunk, self.config.group.groups_per_step)
        for start in range(0, len(groups), size):
            if len(trainable) >= self.config.group.groups_per_step:
                return
            yield from self.rewards.review_groups(groups[start:start + size], defer_ranking=defer)

    def _ready_groups(self) -> list[list[Rollout]]:
        """Finished, unconsumed train rollouts grouped by task: full groups, or timed-out ones."""
        g = self.config.group
        pool = self.store.query_rollouts(mode="train", status=["succeeded", "failed", "timeout"],
                                         consumed=False, claimed=False)
        groups: dict[str, list[Rollout]] = {}
        for r in pool:
            groups.setdefault(r.task_id, []).append(r)
        now = time.time()
        ready = []
        for members in groups.values():
            oldest = min(r.ended_at or r.created_at for r in members)
            if len(members) >= g.group_size or now - oldest > g.group_timeout_s:
                ready.append(members[: g.group_size])
        return ready

    def _drop_stale(self, groups: list[list[Rollout]]) -> list[list[Rollout]]:
        """The groups with a member fresh enough to train; those without one leave the pool now,
        skipped as stale before anything scores them (a judge would rank them for nothing)."""
        fresh = []
        for members in groups:
            if not self._all_stale(members):
                fresh.append(members)
            elif self._take(members):
                self._skip(members, Counter(stale=len(members)))
        return fresh

    def _rankable_groups(self) -> list[list[Rollout]]:
        """The ready groups a ranking judge may rank ahead: those with a member fresh enough to train."""
        return [m for m in self._ready_groups() if not self._all_stale(m)]

    def _all_stale(self, members: Sequence[Rollout]) -> bool:
        current = self.engine.policy_version
        return all(self._too_stale(r, current) for r in members)

    def _take(self, members: Sequence[Rollout]) -> bool:
        """Claim a whole group or nothing (another daemon got part of it)."""
        ids = [r.id for r in members]
        got = self.store.claim_rollouts(ids, self.config.trainer_id)
        if len(got) != len(ids):
            self.store.release_claims(self.config.trainer_id, got)
            return False
        return True

    def _skip(self, rollouts: Sequence[Rollout], reasons: Counter[str]) -> None:
        if rollouts:
            self.store.skip_rollouts([r.id for r in rollouts], self.config.trainer_id)
        for r in rollouts:
            self.rewards.reasons.pop(r.id, None)
        self._skipped_since_step.update(reasons)
        self.skipped_total.update(reasons)
        if reasons:
            log.info("skipped rollouts: %s (total %s)", dict(reasons), dict(self.skipped_total))

    def _filter(self, members: Sequence[Rollout]) -> tuple[list[Rollout], Counter[str]]:
        """Rollouts of a group that may train; the rest counted by reason."""
        reasons: Counter[str] = Counter()
        usable = []
        current = self.engine.policy_version
        for r in members:
            if r.status not in self.config.group.statuses:
                reasons[f"status_{r.status}"] += 1
            elif r.final_reward is None:
                reasons[self.rewards.reasons.get(r.id, "no_reward")] += 1
            elif self._too_stale(r, current):
                reasons["stale"] += 1
            else:
                usable.append(r)
        return usable, reasons

    def _too_stale(self, r: Rollout, current: int) -> bool:
        if r.policy_version is None:
            # Unknown lag: sync mode promises on-policy batches and cannot check it; async mode
            # keeps it (the PPO ratio against the behaviour log-probs still applies).
            return self.config.mode == "sync"
        lag = current - r.policy_version
        if self.config.mode == "sync":
            return lag != 0
        return lag > self.config.max_staleness and self.config.stale == "drop"

    def train(self, batch: Batch) -> StepResult | None:
        t0 = time.perf_counter()
        rollouts = batch.rollouts
        calls = self.store.calls_for([r.id for r in rollouts], training_only=True)
        rows, row_stats = build_rows_for_rollouts(((r, calls[r.id]) for r in rollouts), max_len=self.config.max_len)
        algorithm = self.config.algorithm
        if algorithm == "grpo" and not self.config.norm_by_std:
            algorithm = "dr_grpo"
        parts = self.engine.route(rows) if isinstance(self.engine, RoutesRows) else None
        steps = self.credit.for_batch(rollouts, calls)
        from trainer_backend.algorithms.advantages import label

        rows = label(algorithm, rollouts, rows, level=self.config.advantage_level, parts=parts,
                               agent_rewards=self.store.agent_rewards([r.id for r in rollouts]) if parts else None,
                               credit=steps)
        # for the metrics: one advantage per rollout and policy (rollout level)
        adv = {(row.rollout_id, row.policy): row.advantage for row in rows}
        t_build = time.perf_counter() - t0
        if not rows:  # nothing trainable (no token IDs?): no update, no new version; consumed as skipped
            log.warning("a batch of %d rollouts had no trainable rows (calls without token IDs?); skipped",
                        len(rollouts))
            self._skip(rollouts, Counter({"no_trainable_rows": len(rollouts)}))
            return None
        drift, drift_data = self.drift.measure(rollouts, calls, row_stats)
        engine_metrics = self.engine.step(rows)
        version = self.engine.policy_version
        t_save = time.perf_counter()
        ckpt = self._save(version)
        t_save = time.perf_counter() - t_save
        publish = self._publish(ckpt, version)
        if self.publisher is not None:  # a served template that changed: refused before the commit
            self.drift.after_publish(version, self._step + 1)
        self._step += 1
        metrics = self._metrics(rollouts, rows, row_stats, adv, engine_metrics, batch.skipped, t_build, t_save,
                                time.perf_counter() - t0, publish) | self.credit.metrics(rows, steps) | drift
        findings = self.health.check(metrics)
        for f in findings:
            metrics[f"health_{f.kind}"] = 1.0
            log.warning("step %d, %s: %s. Remedy: %s", self._step, f.kind, f.message, f.remedy)
        self.store.commit_train_step(
            TrainStep(step=self._step, policy_version=version, metrics=metrics,
                      rollout_ids=tuple(r.id for r in rollouts), trainer_id=self.config.trainer_id),
            PolicyVersion(version=version, path=str(ckpt), trainer_id=self.config.trainer_id,
                          metadata={"step": self._step}),
            run_id=self.run_id,
        )
        self.drift.record(self._step, drift_data)
        for f in findings:  # after the commit: an event of a step that exists
            self.store.add_event(Event(kind=f.kind, message=f.message, source=self.config.trainer_id, step=self._step,
                                       data={**f.data, "remedy": f.remedy}))
        self._evaluate(version, ckpt)
        self._prune_checkpoints(version)
        log.info("step %d -> version %d: reward %.3f, loss %.4f, %d rows, %.1fs", self._step, version,
                 metrics["reward_mean"], metrics.get("loss", float("nan")), len(rows), metrics["step_time_s"])
        return StepResult(step=self._step, policy_version=version, metrics=metrics)

    # -- helpers -------------------------------------------------------------
    def _save(self, version: int) -> Path:
        out = Path(self.config.checkpoint_dir) / f"v{version:06d}"
        if out.exists():  # left by a step that crashed before committing
            shutil.rmtree(out)
        return self.engine.save(out)

    def _publish(self, ckpt: Path, version: int) -> dict[str, Any]:
        if self.publisher is None:
            return {}
        result = self.publisher.publish(ckpt, version)
        if dataclasses.is_dataclass(result) and not isinstance(result, type):
            return {f"publish_{k}": v for k, v in dataclasses.asdict(result).items()
                    if isinstance(v, (int, float, bool, str))}
        return {}

    def _evaluate(self, version: int, ckpt: Path) -> None:
        if self.evaluation is None or self.evaluation.after_step(self._step, version, ckpt) is None:
            return
        if self.evaluation.should_stop:
            best = self.evaluation.best
            msg = (f"no improvement of {self.evaluation.policy.metric} in {self.evaluation.policy.patience} "
                   f"evaluations; best {best.value:.4f} at step {best.step} ({best.path})" if best else "stopping")
            log.warning("early stop: %s", msg)
            self.store.add_event(Event(kind="early_stop", message=msg, source=self.config.trainer_id, step=self._step))
            self._stop.set()

    def _prune_checkpoints(self, current: int) -> None:
        root = Path(self.config.checkpoint_dir)
        versions = sorted(p for p in root.glob("v*") if p.is_dir())
        keep = protected_checkpoints(self.config.checkpoint_dir) | {f"v{current:06d}"}  # the best is never pruned
        for old in versions[: max(0, len(versions) - self.config.keep_checkpoints)]:
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def _metrics(self, rollouts: Sequence[Rollout], rows: Sequence[Any], row_stats: RowStats,
                 adv: dict[tuple[str, str | None], float], engine_metrics: dict[str, float], skipped: dict[str, int],
                 t_build: float, t_save: float, t_total: float, publish: dict[str, Any]) -> dict[str, Any]:
        rewards = [float(r.final_reward or 0.0) for r in rollouts]
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / max(1, len(rewards) - 1)) ** 0.5
        current = self.engine.policy_version - (1 if rows else 0)
        lags = [current - r.policy_version for r in rollouts if r.policy_version is not None]
        advs = list(adv.values())
        return {
            **{k: float(v) for k, v in engine_metrics.items() if isinstance(v, (int, float))},
            "reward_mean": mean,
            "reward_std": std,
            "reward_min": min(rewards),
            "reward_max": max(rewards),
            # the distribution beyond mean/std: quartiles (statistics' "inclusive" method, as numpy's default)
            **dict(zip(("reward_p25", "reward_median", "reward_p75"), _quartiles(rewards))),
            "success_rate": sum(1 for x in rewards if x >= self.config.success_threshold) / len(rewards),
            "adv_mean": sum(advs) / len(advs),
            "adv_abs_mean": sum(abs(a) for a in advs) / len(advs),
            "n_rollouts": len(rollouts),
            "n_groups": len({r.task_id for r in rollouts}),
            "n_rows": len(rows),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness_max": max(lags, default=0),
            "batch_build_s": t_build,
            "save_s": t_save,
            "step_time_s": t_total,
            **{f"rows_{k}": v for k, v in row_stats.as_dict().items()},
            **{f"skipped_{k}": v for k, v in skipped.items()},
            **self.rewards.step_metrics(rollouts),
            **publish,
        }


def _reward_profile(r: Rollout, per_agent: dict[str, dict[str, float]], per_step: dict[str, dict[int, float]]
                    ) -> tuple[Any, ...]:
    """What a group's members must differ in to carry signal: the rollout's reward and, with
    separate policies per agent, its roles' own rewards (the team's may be equal while theirs differ),
    with per-turn credit its per-step rewards."""
    return (r.final_reward, *sorted(per_agent.get(r.id, {}).items()), *sorted(per_step.get(r.id, {}).items()))


def _quartiles(values: Sequence[float]) -> list[float]:
    if len(values) < 2:
        return [values[0]] * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def _beat(daemon_ref: weakref.ref[TrainerDaemon], closed: threading.Event, interval_s: float) -> None:
    """Renew the daemon's lease until it is closed. The thread holds the daemon weakly: one dropped
    without `close()` stops beating once collected, and its lease then expires, instead of a
    thread nobody can reach renewing it (and logging against a store that is gone) forever."""
    while not closed.wait(interval_s):
        daemon = daemon_ref()
        if daemon is None:
            return
        try:
            daemon.store.trainer_heartbeat(daemon.config.trainer_id, daemon.run_id)
        except LeaseLost as exc:  # another run took the id over: this one must not commit
            log.error("%s; stopping", exc)
            daemon.stop()
            return
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the next beat retries
            log.warning("trainer lease heartbeat failed: %s", exc)
        del daemon  # not held across the wait
