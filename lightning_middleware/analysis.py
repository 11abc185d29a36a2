"""Analysis helpers for notebooks: a trace store as pandas DataFrames, plus summaries.

    from lightning_middleware import analysis as A
    store = A.open_store("sqlite:///runs/traces.db")      # or a TraceStore, or None (env LIGHTNING_STORE_URL)
    rollouts = A.load_rollouts(store)                     # one row per rollout, with token/turn/latency columns
    A.success_by_task(rollouts)
    print(A.transcript(store, rollouts.rollout_id[0]).text())

pandas is imported inside the functions, so importing this module (and the
package) stays light. Everything here only reads the store.

Success: a rollout succeeded when its status is "succeeded" and its final reward
is >= `success_threshold` (default 1.0; pass your own for other reward scales).
"""

from __future__ import annotations

import html as _html
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import schema as S
from .records import LLMCall, Rollout
from .store import StoreError, TraceStore, default_store_url

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = [
    "DEFAULT_SUCCESS_THRESHOLD",
    "Transcript",
    "best_and_worst",
    "latency_summary",
    "load_calls",
    "load_policy_versions",
    "load_rewards",
    "load_rollouts",
    "load_train_steps",
    "open_store",
    "per_agent",
    "prefix_break_rate",
    "retries",
    "reward_by_policy_version",
    "reward_by_train_step",
    "row_stats",
    "success_by_task",
    "tokens_and_turns",
    "trained_spans",
    "transcript",
]

DEFAULT_SUCCESS_THRESHOLD = 1.0
_TOKEN_BYTES = 4  # token IDs are packed int32 (see _codec)


def open_store(store: TraceStore | str | None = None) -> TraceStore:
    """A TraceStore from an instance, a URL, or None (env LIGHTNING_STORE_URL / ./lightning_traces.db).

    A URL is opened read-only in spirit: nothing is created. A SQLite file that does not
    exist, or a database without the trace tables, raises StoreError saying so.
    """
    if isinstance(store, TraceStore):
        return store
    url = store or default_store_url()
    parsed = sa.make_url(url) if "://" in url else None
    if parsed is not None and parsed.drivername.startswith("sqlite") and parsed.database not in (None, "", ":memory:"):
        if not os.path.exists(parsed.database):
            raise StoreError(f"no trace store at {url}: file {parsed.database!r} does not exist")
    st = TraceStore(url, create=False)
    if not sa.inspect(st.engine).has_table(S.rollouts.name):
        st.close()
        raise StoreError(f"{st.safe_url} has no trace tables (not a lightning-middleware store?)")
    return st


def _pd() -> Any:
    import pandas as pd

    return pd


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
    pd = _pd()
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
    """Every reward event: rollout_id, name, value, final, created_at, metadata (one query)."""
    pd = _pd()
    st = open_store(store)
    r = S.rewards.c
    q = sa.select(r.id, r.rollout_id, r.name, r.value, r.final, r.created_at, r.metadata).order_by(r.id)
    with st.engine.connect() as conn:
        rows = [{**dict(x._mapping), "final": bool(x.final), "metadata": x.metadata or {}} for x in conn.execute(q)]
    return pd.DataFrame(rows, columns=["id", "rollout_id", "name", "value", "final", "created_at", "metadata"])


def tokens_and_turns(calls: pd.DataFrame) -> pd.DataFrame:
    """Per rollout, from `load_calls`: turns (training calls), attempts, tokens, latency, retries, agents.

    Columns: n_attempts, n_turns, n_failed, n_retries, prompt_tokens, completion_tokens,
    total_tokens (prompt + completion of the training calls), max_prompt_tokens, llm_latency_s
    (sum over all attempts), n_agents. Indexed by rollout_id.
    """
    pd = _pd()
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
    pd = _pd()
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
    return {"rollout_id": r.id, "task_id": r.task_id, "mode": r.mode, "status": r.status,
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
    pd = _pd()
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
    pd = _pd()
    st = open_store(store)
    return pd.DataFrame([{"version": p.version, "path": p.path, "checksum": p.checksum,
                          "created_at": p.created_at, "metadata": p.metadata} for p in st.policy_versions()],
                        columns=["version", "path", "checksum", "created_at", "metadata"])


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
    pd = _pd()
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
    pd = _pd()
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
    pd = _pd()
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


def best_and_worst(rollouts: pd.DataFrame, n: int = 3, *, status: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The n highest- and n lowest-reward rollouts (rollouts without a reward are left out)."""
    df = rollouts[rollouts["final_reward"].notna()]
    if status is not None:
        df = df[df["status"] == status]
    df = df.sort_values(["final_reward", "created_at"])
    return df.tail(n).iloc[::-1], df.head(n)


# --------------------------------------------------------------------------
# Training rows: prefix breaks and trained tokens (trainer_backend.rows, no torch)
# --------------------------------------------------------------------------

def row_stats(store: TraceStore | str | None = None, *, rollout_ids: Sequence[str] | None = None,
              max_len: int | None = None) -> pd.DataFrame:
    """Per rollout, the trainer's row-building counters (`trainer_backend.rows.RowStats`).

    Columns: rollout_id, task_id, calls_in, calls_used, merges, prefix_breaks, prefix_break_rate,
    rows, response_tokens, total_tokens, truncated_rows, skipped_* and dropped_* counters.
    """
    from trainer_backend.rows import build_rows

    pd = _pd()
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


def trained_spans(calls: Sequence[LLMCall], *, rollout_id: str = "", max_len: int | None = None
                  ) -> dict[str, tuple[int, int]]:
    """For each call id: (trained completion tokens, completion tokens), as the trainer builds rows.

    A call the trainer skips (failed, partial, not training, superseded attempt) maps to (0, n);
    truncation at `max_len` cuts the trained count of the calls at the end of a row.
    """
    from trainer_backend.rows import build_rows

    rows, _ = build_rows(list(calls), rollout_id=rollout_id, max_len=max_len)
    by_id = {c.id: c for c in calls}
    out = {c.id: (0, len(c.completion_token_ids)) for c in calls}
    for row in rows:
        for cid in row.call_ids:
            c = by_id[cid]
            start = len(c.prompt_token_ids)  # the prompt is a prefix of the row, so the completion starts here
            end = start + len(c.completion_token_ids)
            trained = sum(row.loss_mask[start:min(end, len(row))]) if start < len(row) else 0
            out[cid] = (trained, len(c.completion_token_ids))
    return out


# --------------------------------------------------------------------------
# Transcript
# --------------------------------------------------------------------------

@dataclass
class TranscriptEntry:
    """One line of a transcript: a message the agent sent, a reply, a failed attempt, or a reward."""

    kind: str  # "header" | "call" | "message" | "reply" | "attempt" | "reward"
    text: str
    role: str | None = None
    trained: tuple[int, int] | None = None  # (trained tokens, completion tokens) for replies
    call_index: int | None = None


@dataclass
class Transcript:
    """A readable account of one rollout; `text()` for a terminal, `html()` (and notebook display)
    marks the trained reply tokens."""

    rollout: Rollout
    entries: list[TranscriptEntry] = field(default_factory=list)

    def text(self) -> str:
        lines = []
        for e in self.entries:
            if e.kind == "header":
                lines.append(f"=== {e.text}")
            elif e.kind in ("call", "attempt"):
                lines.append(f"--- {e.text}")
            elif e.kind == "reward":
                lines.append(f"*** reward {e.text}")
            elif e.kind == "reply":
                k, n = e.trained or (0, 0)
                tag = "trained" if n and k == n else (f"trained {k}/{n} tokens" if k else "not trained")
                lines.append(f"[{e.role}] <<{tag}>> {e.text}")
            else:
                lines.append(f"[{e.role}] {e.text}")
        return "\n".join(lines)

    def html(self) -> str:
        parts = ['<div class="lmw-transcript" style="font-family:monospace;white-space:pre-wrap">']
        for e in self.entries:
            t = _html.escape(e.text)
            if e.kind == "header":
                parts.append(f"<h4>{t}</h4>")
            elif e.kind in ("call", "attempt"):
                parts.append(f'<div style="color:#666;border-top:1px solid #ddd">{t}</div>')
            elif e.kind == "reward":
                parts.append(f"<div><b>reward</b> {t}</div>")
            elif e.kind == "reply":
                k, n = e.trained or (0, 0)
                title = f"{k}/{n} completion tokens trained"
                if k and k == n:
                    body = f'<mark class="trained" title="{title}">{t}</mark>'
                elif k:
                    body = f'<mark class="trained partly" title="{title}" style="background:#fe9">{t}</mark>'
                else:
                    body = f'<span class="untrained" title="{title}">{t}</span>'
                parts.append(f"<div><b>[{_html.escape(e.role or '')}]</b> {body}</div>")
            else:
                parts.append(f"<div><b>[{_html.escape(e.role or '')}]</b> {t}</div>")
        parts.append("</div>")
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        return self.html()

    def __str__(self) -> str:
        return self.text()


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _message_text(m: dict[str, Any]) -> str:
    text = _content_text(m.get("content"))
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        text += f"{' ' if text else ''}call {fn.get('name')}({fn.get('arguments')})"
    if m.get("role") == "tool" and m.get("tool_call_id"):
        text = f"({m['tool_call_id']}) {text}"
    return text


def reply_message(call: LLMCall) -> dict[str, Any] | None:
    """The assistant message of a chat call's response (or a completion's text as one), if any."""
    choices = (call.response or {}).get("choices") or []
    if not choices:
        return None
    ch = choices[0]
    if isinstance(ch.get("message"), dict):
        return ch["message"]
    if "text" in ch:
        return {"role": "assistant", "content": ch["text"]}
    return None


def transcript(store: TraceStore | str | None, rollout_id: str, *, max_len: int | None = None,
               max_chars: int = 2000) -> Transcript:
    """The rollout's messages, tool calls, failed attempts and rewards, with trained replies marked.

    Each call shows only the messages new since the previous call (when the conversation
    grows by appending, as chat agents do); a call whose messages don't extend the previous
    ones is flagged "context rewritten". Texts longer than `max_chars` are cut.
    """
    st = open_store(store)
    r = st.get_rollout(rollout_id)
    if r is None:
        raise KeyError(f"no rollout {rollout_id!r} in {st.safe_url}")
    calls = st.calls(rollout_id)
    spans = trained_spans(calls, rollout_id=rollout_id, max_len=max_len)
    cut = (lambda s: s if len(s) <= max_chars else s[:max_chars] + f"... [{len(s) - max_chars} more chars]")
    t = Transcript(r)
    t.entries.append(TranscriptEntry("header", (
        f"rollout {r.id} task={r.task_id} mode={r.mode} status={r.status} reward={r.final_reward} "
        f"policy_version={r.policy_version} duration={r.duration_s if r.duration_s is None else round(r.duration_s, 3)}s"
        + (f" error={r.error}" if r.error else ""))))
    if r.input is not None:
        t.entries.append(TranscriptEntry("message", cut(json.dumps(r.input, default=str)), role="input"))
    seen: dict[str | None, list[dict[str, Any]]] = {}  # per agent: the last request's messages
    replied: dict[str | None, bool] = {}
    for c in calls:
        ok = c.status_code is not None and 200 <= c.status_code < 300
        head = (f"call {c.call_index} attempt {c.attempt}" + (f" agent={c.agent_name}" if c.agent_name else "")
                + f" model={c.model} prompt={len(c.prompt_token_ids)} completion={len(c.completion_token_ids)} tokens"
                + (f" latency={c.latency_s * 1000:.1f}ms" if c.latency_s is not None else "")
                + f" training={c.is_training}" + (" partial" if c.partial else ""))
        if not ok:
            t.entries.append(TranscriptEntry("attempt", f"{head} FAILED status={c.status_code} {c.error or ''}".rstrip(),
                                             call_index=c.call_index))
            continue
        t.entries.append(TranscriptEntry("call", head, call_index=c.call_index))
        msgs = list((c.request or {}).get("messages") or [])
        if not msgs and "prompt" in (c.request or {}):
            msgs = [{"role": "prompt", "content": str(c.request["prompt"])}]
        prev = seen.get(c.agent_name)
        if prev is not None and msgs[:len(prev)] == prev:
            new = msgs[len(prev):]
            if replied.get(c.agent_name) and new and new[0].get("role") == "assistant":
                new = new[1:]  # the previous reply, sent back: already shown
        else:
            if prev is not None:
                t.entries.append(TranscriptEntry("attempt", "context rewritten: the messages do not extend the "
                                                 "previous call's (a prefix break for training)",
                                                 call_index=c.call_index))
            new = msgs
        for m in new:
            t.entries.append(TranscriptEntry("message", cut(_message_text(m)), role=str(m.get("role")),
                                             call_index=c.call_index))
        reply = reply_message(c)
        if reply is not None:
            t.entries.append(TranscriptEntry("reply", cut(_message_text(reply)), role="assistant",
                                             trained=spans.get(c.id), call_index=c.call_index))
        seen[c.agent_name], replied[c.agent_name] = msgs, reply is not None
    for rw in st.rewards(rollout_id):
        t.entries.append(TranscriptEntry("reward", f"{rw.value}" + (f" name={rw.name}" if rw.name else "")
                                         + (" (final)" if rw.final else "")))
    return t
