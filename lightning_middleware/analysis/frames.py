"""A trace store as pandas DataFrames: rollouts, calls, rewards, train steps, policy versions.

pandas is imported inside the functions, so importing this module stays light. Everything
here only reads the store. Success: a rollout succeeded when its status is "succeeded" and
its final reward is >= `success_threshold` (default 1.0; pass your own for other scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from lightning_middleware.records import Rollout
from lightning_middleware.store import TraceStore, open_store
from lightning_middleware.store import schema as S

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

DEFAULT_SUCCESS_THRESHOLD = 1.0
_TOKEN_BYTES = 4  # token IDs are packed int32 (see store/codec.py)


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

_CALL_COLUMNS = [
    "call_id", "rollout_id", "call_index", "attempt", "endpoint", "model", "agent_name", "status_code",
    "ok", "is_training", "partial", "stream", "finish_reason", "prompt_tokens", "completion_tokens",
    "has_logprobs", "latency_s", "started_at", "policy_version", "error",
]


def load_calls(store: TraceStore | str | None = None, *, rollout_ids: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per recorded HTTP attempt (no request/response bodies: they stay in the store).

    Columns: call_id, rollout_id, call_index, attempt, endpoint, model, agent_name, status_code,
    ok (2xx), is_training, partial, stream, finish_reason, prompt_tokens, completion_tokens,
    has_logprobs, latency_s, started_at, policy_version, error. Token counts come from the
    packed token-ID columns without unpacking them.
    """
    import pandas as pd

    st = open_store(store)
    c = S.llm_calls.c
    q = sa.select(
        c.id, c.rollout_id, c.call_index, c.attempt, c.endpoint, c.model, c.agent_name, c.status_code,
        c.is_training, c.partial, c.stream, c.finish_reason,
        sa.func.coalesce(sa.func.length(c.prompt_token_ids), 0).label("pbytes"),
        sa.func.coalesce(sa.func.length(c.completion_token_ids), 0).label("cbytes"),
        c.logprobs.is_not(None).label("has_logprobs"),
        c.latency_s, c.started_at, c.policy_version, c.error,
    ).order_by(c.rollout_id, c.call_index, c.attempt, c.started_at)
    if rollout_ids is not None:
        q = q.where(c.rollout_id.in_(list(rollout_ids)))
    with st.engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(q)]
    for r in rows:
        r["call_id"] = r.pop("id")
        r["prompt_tokens"] = int(r.pop("pbytes")) // _TOKEN_BYTES
        r["completion_tokens"] = int(r.pop("cbytes")) // _TOKEN_BYTES
        code = r["status_code"]
        r["ok"] = code is not None and 200 <= code < 300
        for k in ("is_training", "partial", "stream", "has_logprobs"):
            r[k] = bool(r[k])
    df = pd.DataFrame(rows, columns=_CALL_COLUMNS)
    return df.astype({"prompt_tokens": "int64", "completion_tokens": "int64", "latency_s": "float64"})


def load_rewards(store: TraceStore | str | None = None) -> pd.DataFrame:
    """Every reward event: rollout_id, name, value, final, created_at, metadata, call_index (a
    per-step reward's call), config_hash (a configured component's configuration), agent (a
    per-agent reward's agent) (one query)."""
    import pandas as pd

    st = open_store(store)
    r = S.rewards.c
    q = sa.select(r.id, r.rollout_id, r.name, r.value, r.final, r.created_at, r.metadata, r.call_index,
                  r.config_hash, r.agent).order_by(r.id)
    with st.engine.connect() as conn:
        rows = [{**dict(x._mapping), "final": bool(x.final), "metadata": x.metadata or {}} for x in conn.execute(q)]
    return pd.DataFrame(rows, columns=["id", "rollout_id", "name", "value", "final", "created_at", "metadata",
                                       "call_index", "config_hash", "agent"])


def tokens_and_turns(calls: pd.DataFrame) -> pd.DataFrame:
    """Per rollout, from `load_calls`: turns (training calls), attempts, tokens, latency, retries, agents.

    Columns: n_attempts, n_turns, n_failed, n_retries, prompt_tokens, completion_tokens,
    total_tokens (prompt + completion of the training calls), max_prompt_tokens, llm_latency_s
    (sum over all attempts), n_agents. Indexed by rollout_id.
    """
    import pandas as pd

    df = calls[calls["rollout_id"].notna()]
    if df.empty:
        return pd.DataFrame(columns=["n_attempts", "n_turns", "n_failed", "n_retries", "prompt_tokens",
                                     "completion_tokens", "total_tokens", "max_prompt_tokens", "llm_latency_s",
                                     "n_agents"]).rename_axis("rollout_id")
    train = df[df["is_training"]]
    g = df.groupby("rollout_id")
    tg = train.groupby("rollout_id")
    out = pd.DataFrame({
        "n_attempts": g.size(),
        "n_turns": tg.size(),
        "n_failed": g["ok"].agg(lambda s: int((~s).sum())),
        "n_retries": g["attempt"].agg(lambda s: int((s > 1).sum())),
        "prompt_tokens": tg["prompt_tokens"].sum(),
        "completion_tokens": tg["completion_tokens"].sum(),
        "max_prompt_tokens": tg["prompt_tokens"].max(),
        "llm_latency_s": g["latency_s"].sum(),
        "n_agents": g["agent_name"].agg(lambda s: s.fillna("").nunique()),
    })
    for col in ("n_turns", "prompt_tokens", "completion_tokens", "max_prompt_tokens"):
        out[col] = out[col].fillna(0).astype("int64")
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out.rename_axis("rollout_id")


def load_rollouts(store: TraceStore | str | None = None, *, mode: str | None = None,
                  status: str | Sequence[str] | None = None, task_id: str | Sequence[str] | None = None,
                  success_threshold: float = DEFAULT_SUCCESS_THRESHOLD, calls: pd.DataFrame | None = None
                  ) -> pd.DataFrame:
    """One row per rollout: the rollout's fields, `success`, and the `tokens_and_turns` columns.

    Columns: rollout_id, task_id, mode, status, final_reward, success, policy_version,
    created_at, ended_at, duration_s, error, claimed_by, consumed_step, n_rewards, then
    n_attempts, n_turns, n_failed, n_retries, prompt_tokens, completion_tokens, total_tokens,
    max_prompt_tokens, llm_latency_s, n_agents (0 for a rollout without calls).
    """
    import pandas as pd

    st = open_store(store)
    rs = st.query_rollouts(mode=mode, status=status, task_id=task_id)
    base = pd.DataFrame([_rollout_dict(r) for r in rs], columns=[
        "rollout_id", "task_id", "mode", "status", "final_reward", "policy_version", "created_at", "ended_at",
        "duration_s", "error", "claimed_by", "consumed_step", "input", "metadata"])
    base["final_reward"] = base["final_reward"].astype("float64")
    base["success"] = (base["status"] == "succeeded") & (base["final_reward"] >= success_threshold)
    rewards = load_rewards(st)
    counts = rewards.groupby("rollout_id").size() if not rewards.empty else pd.Series(dtype="int64")
    base["n_rewards"] = base["rollout_id"].map(counts).fillna(0).astype("int64")
    if calls is None:
        calls = load_calls(st, rollout_ids=list(base["rollout_id"])) if len(base) else load_calls(st, rollout_ids=[])
    per = tokens_and_turns(calls)
    out = base.merge(per, how="left", left_on="rollout_id", right_index=True)
    for col in per.columns:
        if col == "llm_latency_s":
            out[col] = out[col].fillna(0.0).astype("float64")
        else:
            out[col] = out[col].fillna(0).astype("int64")
    return out.reset_index(drop=True)


def _rollout_dict(r: Rollout) -> dict[str, Any]:
    return {"rollout_id": r.id, "task_id": r.task_id, "mode": r.mode.value, "status": r.status.value,
            "final_reward": r.final_reward, "policy_version": r.policy_version, "created_at": r.created_at,
            "ended_at": r.ended_at, "duration_s": r.duration_s, "error": r.error, "claimed_by": r.claimed_by,
            "consumed_step": r.consumed_step, "input": r.input, "metadata": r.metadata}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def load_train_steps(store: TraceStore | str | None = None, *, trainer_id: str | None = None) -> pd.DataFrame:
    """One row per training step: step, trainer_id, policy_version, created_at, n_rollouts, and
    one column per metric in `train_steps.metrics` (nested dicts flattened as "a/b")."""
    import pandas as pd

    st = open_store(store)
    rows = []
    for s in st.train_steps(trainer_id):
        rows.append({"step": s.step, "trainer_id": s.trainer_id, "policy_version": s.policy_version,
                     "created_at": s.created_at, "n_rollouts": len(s.rollout_ids), **_flatten(s.metrics)})
    fixed = ["step", "trainer_id", "policy_version", "created_at", "n_rollouts"]
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=fixed)
    return df[fixed + [c for c in df.columns if c not in fixed]]


def load_policy_versions(store: TraceStore | str | None = None) -> pd.DataFrame:
    """One row per published policy version: version, path, checksum, created_at, metadata."""
    import pandas as pd

    st = open_store(store)
    return pd.DataFrame([{"version": p.version, "path": p.path, "checksum": p.checksum,
                          "created_at": p.created_at, "metadata": p.metadata} for p in st.policy_versions()],
                        columns=["version", "path", "checksum", "created_at", "metadata"])
