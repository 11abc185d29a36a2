"""Summaries of loaded frames: reward and success by policy version, step and task, latency,
retries, per-agent figures, best and worst rollouts, and the trainer's row statistics."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_middleware.analysis.frames import load_calls, load_rewards
from lightning_middleware.rows import build_rows
from lightning_middleware.store import TraceStore, open_store

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


# --------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------

def _reward_agg(df: pd.DataFrame, by: str | list[str]) -> pd.DataFrame:
    g = df.groupby(by, dropna=False)
    out = g.agg(n=("rollout_id", "size"), mean_reward=("final_reward", "mean"), std_reward=("final_reward", "std"),
                min_reward=("final_reward", "min"), max_reward=("final_reward", "max"),
                success_rate=("success", "mean"))
    out["success_rate"] = out["success_rate"].astype("float64")
    return out


def reward_by_policy_version(rollouts: pd.DataFrame, *, mode: str | None = None) -> pd.DataFrame:
    """Per policy version (and mode): n, mean/std/min/max reward, success rate. Rows without a version: NaN."""
    df = rollouts if mode is None else rollouts[rollouts["mode"] == mode]
    return _reward_agg(df, ["policy_version", "mode"] if mode is None else "policy_version")


def reward_by_train_step(rollouts: pd.DataFrame, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per training step, the rollouts it consumed: n, mean/std/min/max reward, success rate.

    With `steps` (from `load_train_steps`) the step's policy_version and created_at are joined in.
    """
    df = rollouts[rollouts["consumed_step"].notna()].copy()
    df["step"] = df["consumed_step"].astype("int64")
    out = _reward_agg(df, "step")
    if steps is not None and not steps.empty:
        info = steps.drop_duplicates("step", keep="last").set_index("step")[["policy_version", "created_at"]]
        out = out.join(info, how="left")
    return out


def success_by_task(rollouts: pd.DataFrame, *, mode: str | None = None) -> pd.DataFrame:
    """Per task (GRPO group): n, mean/std/min/max reward, success rate; lowest success first."""
    df = rollouts if mode is None else rollouts[rollouts["mode"] == mode]
    return _reward_agg(df, "task_id").sort_values(["success_rate", "mean_reward"])


def latency_summary(calls: pd.DataFrame, *, by: str | list[str] | None = None) -> pd.DataFrame:
    """LLM latency quantiles in seconds (n, mean, p50, p90, p99, max), over successful attempts.

    `by`: e.g. "model" or "agent_name"; None gives one row ("all").
    """
    import pandas as pd

    df = calls[calls["ok"] & calls["latency_s"].notna()].copy()
    if by is None:
        df["_all"] = "all"
        by = "_all"
    g = df.groupby(by, dropna=False)["latency_s"]
    out = pd.DataFrame({"n": g.size(), "mean": g.mean(), "p50": g.quantile(0.5), "p90": g.quantile(0.9),
                        "p99": g.quantile(0.99), "max": g.max()})
    if by == "_all":
        out = out.reindex(["all"]).rename_axis(None)
    out["n"] = out["n"].fillna(0).astype("int64")
    return out


def retries(calls: pd.DataFrame) -> pd.DataFrame:
    """Attempts that were retries or failed: a table by status code plus a total row.

    Columns: attempts, retries (attempt > 1), failed (not 2xx), partial (stream cut short).
    """
    import pandas as pd

    df = calls.copy()
    df["status"] = df["status_code"].astype("Int64").astype(str).replace("<NA>", "none")
    df["is_retry"] = df["attempt"] > 1
    df["failed"] = ~df["ok"]
    g = df.groupby("status").agg(attempts=("call_id", "size"), retries=("is_retry", "sum"),
                                 failed=("failed", "sum"), partial=("partial", "sum"))
    total = pd.DataFrame([g.sum()], index=["total"])
    return pd.concat([g, total]).astype("int64")


def per_agent(calls: pd.DataFrame, rollouts: pd.DataFrame) -> pd.DataFrame:
    """Per agent name ("(none)" when unnamed): calls, rollouts, tokens, latency, reward of its rollouts."""
    import pandas as pd

    df = calls[calls["rollout_id"].notna()].copy()
    if df.empty:
        return pd.DataFrame(columns=["n_attempts", "n_rollouts", "mean_latency_s", "n_training_calls",
                                     "prompt_tokens", "completion_tokens", "mean_reward", "success_rate"]
                            ).rename_axis("agent")
    df["agent"] = df["agent_name"].fillna("(none)")
    rewards = rollouts.set_index("rollout_id")["final_reward"]
    success = rollouts.set_index("rollout_id")["success"]
    df["final_reward"] = df["rollout_id"].map(rewards)
    df["success"] = df["rollout_id"].map(success).astype("float64")
    train = df[df["is_training"]]
    g = df.groupby("agent")
    tg = train.groupby("agent")
    out = g.agg(n_attempts=("call_id", "size"), n_rollouts=("rollout_id", "nunique"),
                mean_latency_s=("latency_s", "mean"))
    out["n_training_calls"] = tg.size()
    out["prompt_tokens"] = tg["prompt_tokens"].sum()
    out["completion_tokens"] = tg["completion_tokens"].sum()
    per_rollout = df.drop_duplicates(["agent", "rollout_id"]).groupby("agent")
    out["mean_reward"] = per_rollout["final_reward"].mean()
    out["success_rate"] = per_rollout["success"].mean()
    for col in ("n_training_calls", "prompt_tokens", "completion_tokens"):
        out[col] = out[col].fillna(0).astype("int64")
    return out


def best_and_worst(rollouts: pd.DataFrame, n: int = 3, *,
                   status: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The n highest- and n lowest-reward rollouts (rollouts without a reward are left out)."""
    df = rollouts[rollouts["final_reward"].notna()]
    if status is not None:
        df = df[df["status"] == status]
    df = df.sort_values(["final_reward", "created_at"])
    return df.tail(n).iloc[::-1], df.head(n)


# --------------------------------------------------------------------------
# Training rows: prefix breaks and trained tokens (lightning_middleware.rows, no torch)
# --------------------------------------------------------------------------

def row_stats(store: TraceStore | str | None = None, *, rollout_ids: Sequence[str] | None = None,
              max_len: int | None = None) -> pd.DataFrame:
    """Per rollout, the trainer's row-building counters (`lightning_middleware.rows.RowStats`).

    Columns: rollout_id, task_id, calls_in, calls_used, merges, prefix_breaks, prefix_break_rate,
    rows, response_tokens, total_tokens, truncated_rows, skipped_* and dropped_* counters.
    """
    import pandas as pd

    st = open_store(store)
    rs = st.query_rollouts() if rollout_ids is None else [r for r in (st.get_rollout(i) for i in rollout_ids) if r]
    calls = st.calls_for([r.id for r in rs]) if rs else {}
    out = []
    for r in rs:
        _rows, stats = build_rows(calls.get(r.id, []), rollout_id=r.id, task_id=r.task_id, max_len=max_len)
        out.append({"rollout_id": r.id, "task_id": r.task_id, **stats.as_dict()})
    return pd.DataFrame(out)


def prefix_break_rate(stats: pd.DataFrame) -> float:
    """Overall prefix-break rate of a `row_stats` frame: breaks / (merges + breaks), 0.0 when no chance."""
    if stats.empty:
        return 0.0
    breaks, merges = int(stats["prefix_breaks"].sum()), int(stats["merges"].sum())
    return breaks / (breaks + merges) if breaks + merges else 0.0


# --------------------------------------------------------------------------
# Where a training step's time goes
# --------------------------------------------------------------------------

STEP_PHASES = ("waiting_s", "build_s", "forward_backward_s", "save_s", "drain_s", "publish_s", "other_s")
ROLLOUT_PHASES = ("rollout_s", "generation_s", "agent_s", "scoring_s")


def step_breakdown(store: TraceStore | str | None = None, *, trainer_id: str | None = None) -> pd.DataFrame:
    """Where each training step's time went: one row per step, indexed by (trainer_id, step).

    The trainer's side (STEP_PHASES, from the step's own metrics; they sum to `interval_s`, the
    time since the trainer's previous step, NaN for its first): `waiting_s`, the interval less
    the step's own work (waiting for enough finished, scored groups: generation and scoring that
    did not overlap training); `build_s` (the store read, rows and advantages);
    `forward_backward_s` (the engine's step); `save_s` (the checkpoint; NaN in stores from before
    it was recorded, where `other_s` holds it); `drain_s` (the publish's pause of the server and
    the gateway: with `pause="wait"`, waiting for the completions in flight to end, what
    `pause="keep"` gives back; docs/serving.md); `publish_s` (the rest of the publish: the weights
    into the server, the cache reset, the resume); `other_s` (the rest: drift checks, bookkeeping).

    The rollout side (ROLLOUT_PHASES), means over the rollouts the step trained on; in async mode
    these ran while earlier steps trained, so they overlap the trainer's phases: `rollout_s`
    (created to ended), `generation_s` (its LLM calls' latencies summed), `agent_s` (the rest of
    the rollout: the agent's own code and tools), `scoring_s` (ended to its final reward: a judge
    or a late scorer; 0 when the agent reported it).
    """
    import pandas as pd

    st = open_store(store)
    steps = st.train_steps(trainer_id)
    columns = ["trainer_id", "step", "policy_version", "created_at", "rollouts", "interval_s", "step_s",
               *STEP_PHASES, *ROLLOUT_PHASES]
    if not steps:
        return pd.DataFrame(columns=columns).set_index(["trainer_id", "step"])
    rollouts = {r.id: r for r in st.query_rollouts(mode="train")}
    # every call, not an IN over the ids: a long run trains more rollouts than SQLite binds at once
    latency = load_calls(st).groupby("rollout_id")["latency_s"].sum()
    rewards = load_rewards(st)
    final = rewards[rewards["final"]].groupby("rollout_id")["created_at"].max() if not rewards.empty else {}
    rows = []
    for s in steps:
        m = s.metrics
        total = float(m.get("step_time_s", float("nan")))
        build, fb = float(m.get("batch_build_s", 0.0)), float(m.get("time_s", 0.0))
        save, publish = float(m.get("save_s", float("nan"))), float(m.get("publish_total_s", 0.0))
        drain = float(m.get("publish_engine_pause_s", 0.0)) + float(m.get("publish_gateway_pause_s", 0.0))
        per = [rollouts[i] for i in s.rollout_ids if i in rollouts]
        durations = [(r.ended_at or r.created_at) - r.created_at for r in per]
        generation = [float(latency.get(r.id, 0.0)) for r in per]
        scoring = [max(0.0, float(final[r.id]) - (r.ended_at or r.created_at)) for r in per if r.id in final]
        rows.append({
            "trainer_id": s.trainer_id, "step": s.step, "policy_version": s.policy_version,
            "created_at": s.created_at, "rollouts": len(s.rollout_ids), "step_s": total,
            "build_s": build, "forward_backward_s": fb, "save_s": save, "drain_s": drain, "publish_s": publish - drain,
            "other_s": total - build - fb - publish - (0.0 if math.isnan(save) else save),
            "rollout_s": _mean(durations), "generation_s": _mean(generation),
            "agent_s": _mean([d - g for d, g in zip(durations, generation)]), "scoring_s": _mean(scoring),
        })
    df = pd.DataFrame(rows).sort_values(["trainer_id", "created_at"], kind="stable")
    df["interval_s"] = df.groupby("trainer_id")["created_at"].diff()
    df["waiting_s"] = df["interval_s"] - df["step_s"]
    return df[columns].set_index(["trainer_id", "step"])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
