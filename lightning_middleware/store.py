"""The trace store: rollouts, LLM calls, rewards, policy versions, training steps.

One class over SQLAlchemy Core, for SQLite (default, a file in WAL mode) and
PostgreSQL (`postgresql+psycopg://...`). Writes from agents go through a
`BatchWriter` (see writer.py); the trainer, the gateway and notebooks use the
direct methods, each its own short transaction.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import StaticPool

from . import _json
from . import schema as S
from ._codec import pack_floats, pack_ints, unpack_floats, unpack_ints
from .records import EvalResult, LLMCall, PolicyVersion, Reward, Rollout, RolloutStatus, TrainStep
from .writer import BatchWriter, Op, WriterStats

log = logging.getLogger(__name__)

DEFAULT_URL = "sqlite:///./lightning_traces.db"
SKIPPED_STEP = -1  # rollouts.consumed_step of rollouts a trainer took but did not train on
ENV_URL = "LIGHTNING_STORE_URL"


class StoreError(RuntimeError):
    """The store could not be opened or used; the message says what to fix."""


def default_store_url() -> str:
    return os.environ.get(ENV_URL) or DEFAULT_URL


# --------------------------------------------------------------------------
# Opening
# --------------------------------------------------------------------------

def _normalise_url(url: str) -> sa.URL:
    try:
        parsed = sa.make_url(url)
    except sa_exc.ArgumentError as exc:
        raise StoreError(
            f"not a store URL: {url!r} (use sqlite:///path/to/traces.db or postgresql+psycopg://user@host/db)"
        ) from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if not (parsed.drivername.startswith("sqlite") or parsed.drivername.startswith("postgresql")):
        raise StoreError(f"unsupported store engine {parsed.drivername!r}: use sqlite or postgresql")
    return parsed


_JSON_CODEC = {"json_serializer": _json.dumps, "json_deserializer": _json.loads}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # Large pages: a span (~1-3 KB of JSON and packed tokens) fits in one page instead of
    # spilling to overflow pages; inserts run ~1.5x faster. Only takes effect on a new file.
    cur.execute("PRAGMA page_size=16384")
    cur.execute("PRAGMA journal_mode=WAL")  # readers work while the writer writes
    cur.execute("PRAGMA synchronous=NORMAL")  # a process crash loses nothing committed
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def _make_engine(url: sa.URL) -> sa.Engine:
    if url.drivername.startswith("sqlite"):
        path = url.database
        if path and path != ":memory:":
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise StoreError(f"cannot open SQLite store {path!r}: directory {parent!r} does not exist")
            engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 10}, **_JSON_CODEC)
        else:  # in-memory: one shared connection, or every thread would see its own empty database
            engine = sa.create_engine(url, connect_args={"check_same_thread": False}, poolclass=StaticPool,
                                      **_JSON_CODEC)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5, **_JSON_CODEC)


def _is_transient(exc: BaseException) -> bool:
    """Database unavailable (retry later) versus a bad operation (reject it)."""
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


# --------------------------------------------------------------------------
# Row <-> record
# --------------------------------------------------------------------------

_CALL_COLUMNS = tuple(c.name for c in S.llm_calls.columns)
_JSON_COLUMNS = {"request", "response"}
_INSERT_CALLS_QMARK = f"INSERT INTO llm_calls ({', '.join(_CALL_COLUMNS)}) VALUES ({', '.join('?' * len(_CALL_COLUMNS))})"
_COPY_CALLS = f"COPY llm_calls ({', '.join(_CALL_COLUMNS)}) FROM STDIN (FORMAT BINARY)"


def _pg_type(column: sa.Column) -> str:
    """The PostgreSQL type name of a column, for binary COPY (which needs exact types)."""
    t = column.type
    # JSON columns get our pre-serialised text: json's binary input *is* its text.
    if isinstance(t, sa.LargeBinary):
        return "bytea"
    if isinstance(t, sa.Boolean):
        return "bool"
    if isinstance(t, sa.Integer):
        return "int4"
    if isinstance(t, sa.Float):
        return "float8"
    return "text"


_CALL_PG_TYPES = [_pg_type(c) for c in S.llm_calls.columns]


def _json_text(value: Any) -> str | None:
    return None if value is None else _json.dumps(value)


def _call_tuple(call: LLMCall) -> tuple[Any, ...]:
    """One llm_calls row in _CALL_COLUMNS order, ready for the driver."""
    values = {
        "id": call.id,
        "rollout_id": call.rollout_id,
        "call_index": call.call_index,
        "attempt": call.attempt,
        "endpoint": call.endpoint,
        "model": call.model,
        "agent_name": call.agent_name,
        "request": _json_text(call.request),
        "response": _json_text(call.response),
        "prompt_token_ids": pack_ints(call.prompt_token_ids) if call.prompt_token_ids else None,
        "completion_token_ids": pack_ints(call.completion_token_ids) if call.completion_token_ids else None,
        "logprobs": pack_floats(call.logprobs),
        "finish_reason": call.finish_reason,
        "status_code": call.status_code,
        "stream": bool(call.stream),
        "partial": bool(call.partial),
        "is_training": bool(call.is_training),
        "error": call.error,
        "latency_s": call.latency_s,
        "started_at": call.started_at,
        "policy_version": call.policy_version,
        "request_hash": call.request_hash,
    }
    return tuple(values[c] for c in _CALL_COLUMNS)


def _call_record(row: sa.Row) -> LLMCall:
    m = row._mapping
    return LLMCall(
        id=m["id"],
        rollout_id=m["rollout_id"],
        call_index=m["call_index"],
        attempt=m["attempt"],
        endpoint=m["endpoint"],
        model=m["model"],
        agent_name=m["agent_name"],
        request=m["request"] or {},
        response=m["response"],
        prompt_token_ids=unpack_ints(m["prompt_token_ids"]),
        completion_token_ids=unpack_ints(m["completion_token_ids"]),
        logprobs=unpack_floats(m["logprobs"]),
        finish_reason=m["finish_reason"],
        status_code=m["status_code"],
        stream=bool(m["stream"]),
        partial=bool(m["partial"]),
        is_training=bool(m["is_training"]),
        error=m["error"],
        latency_s=m["latency_s"],
        started_at=m["started_at"],
        policy_version=m["policy_version"],
        request_hash=m["request_hash"],
    )


def _rollout_row(r: Rollout) -> dict[str, Any]:
    return {
        "id": r.id,
        "task_id": r.task_id,
        "mode": r.mode,
        "status": r.status,
        "input": r.input,
        "metadata": r.metadata or None,
        "final_reward": r.final_reward,
        "policy_version": r.policy_version,
        "created_at": r.created_at or time.time(),
        "ended_at": r.ended_at,
        "duration_s": r.duration_s,
        "error": r.error,
        "claimed_by": r.claimed_by,
        "consumed_step": r.consumed_step,
    }


def _rollout_record(row: sa.Row) -> Rollout:
    m = dict(row._mapping)
    m["metadata"] = m["metadata"] or {}
    return Rollout(**m)


def _policy_row(pv: PolicyVersion) -> dict[str, Any]:
    return {"version": pv.version, "trainer_id": pv.trainer_id, "path": pv.path, "checksum": pv.checksum,
            "created_at": pv.created_at or time.time(), "metadata": pv.metadata or None}


def _reward_row(reward: Reward) -> dict[str, Any]:
    return {
        "rollout_id": reward.rollout_id, "value": float(reward.value), "name": reward.name,
        "final": bool(reward.final), "created_at": reward.created_at or time.time(),
        "metadata": reward.metadata or None,
    }


def _reward_record(row: sa.Row) -> Reward:
    m = row._mapping
    return Reward(
        id=m["id"], rollout_id=m["rollout_id"], value=m["value"], name=m["name"],
        final=bool(m["final"]), created_at=m["created_at"], metadata=m["metadata"] or {},
    )


# --------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------

class TraceStore:
    """A trace store at `url` (default: env LIGHTNING_STORE_URL or ./lightning_traces.db).

    Raises StoreError at construction if the database can't be opened, so a bad
    URL fails where it is configured, never inside an agent's LLM call.
    """

    def __init__(self, url: str | None = None, *, create: bool = True, writer_interval_s: float = 0.05,
                 max_buffer: int = 200_000) -> None:
        self.url = _normalise_url(url or default_store_url())
        try:
            self.engine = _make_engine(self.url)
            if create:
                self._create_schema()
            else:
                with self.engine.connect():
                    pass
        except StoreError:
            raise
        except ModuleNotFoundError as exc:
            raise StoreError(
                f"cannot open {self.safe_url}: driver missing ({exc.name}); "
                "install lightning-middleware[postgres] for PostgreSQL"
            ) from exc
        except sa_exc.SQLAlchemyError as exc:
            reason = str(getattr(exc, "orig", exc) or exc).strip().splitlines()[0]
            raise StoreError(f"cannot open trace store {self.safe_url}: {reason}") from exc
        self._writer_interval_s = writer_interval_s
        self._max_buffer = max_buffer
        self._writer: BatchWriter | None = None
        self._writer_lock = threading.Lock()

    @property
    def safe_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def __repr__(self) -> str:
        return f"TraceStore({self.safe_url!r})"

    def _create_schema(self) -> None:
        S.metadata.create_all(self.engine)
        with self.engine.begin() as conn:
            found = conn.execute(sa.select(S.schema_info.c.value).where(S.schema_info.c.key == "version")).scalar()
            if found is None:
                try:
                    conn.execute(sa.insert(S.schema_info).values(key="version", value=str(S.SCHEMA_VERSION)))
                except sa_exc.IntegrityError:  # another process created it first
                    pass
            elif int(found) > S.SCHEMA_VERSION:
                raise StoreError(
                    f"{self.safe_url} has schema version {found}, newer than this lightning-middleware "
                    f"({S.SCHEMA_VERSION}); upgrade the package"
                )

    # -- background writes (agents) -----------------------------------------
    @property
    def writer(self) -> BatchWriter:
        if self._writer is None:
            with self._writer_lock:
                if self._writer is None:
                    self._writer = BatchWriter(
                        self._apply_ops, is_transient=_is_transient,
                        interval_s=self._writer_interval_s, max_buffer=self._max_buffer,
                    )
        return self._writer

    # Producers hand over records as they are; turning them into rows happens on
    # the writer thread, so an agent's call pays only for an append.
    def submit_rollout(self, rollout: Rollout) -> None:
        self.writer.submit("rollout", rollout)

    def submit_call(self, call: LLMCall) -> None:
        self.writer.submit("call", call)

    def submit_reward(self, reward: Reward) -> None:
        self.writer.submit("reward", reward)

    def submit_rollout_end(self, rollout_id: str, *, status: str, ended_at: float, duration_s: float | None,
                           error: str | None) -> None:
        self.writer.submit("rollout_end", {
            "id": rollout_id, "status": status, "ended_at": ended_at, "duration_s": duration_s, "error": error,
        })

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Write everything submitted so far; False if the database did not take it in time."""
        return True if self._writer is None else self._writer.flush(timeout)

    def writer_stats(self) -> WriterStats | None:
        return None if self._writer is None else self._writer.stats()

    def close(self, timeout: float | None = 10.0) -> None:
        if self._writer is not None:
            self._writer.close(timeout)
            self._writer = None
        self.engine.dispose()

    def _apply_ops(self, ops: Sequence[Op]) -> None:
        """Apply a batch in one transaction: inserts first, then updates in order.

        A rollout row is always submitted before its calls, rewards and end, so
        doing all inserts of the batch before its updates keeps every update
        after the insert it refers to.
        """
        rollout_rows, calls, reward_rows = [], [], []
        updates: list[tuple[str, dict[str, Any]]] = []
        for kind, item in ops:
            if kind == "call":  # a record, or a captured call still to be parsed (capture._DeferredCall)
                calls.append(item if isinstance(item, LLMCall) else item.build())
            elif kind == "rollout":
                rollout_rows.append(_rollout_row(item))
            elif kind == "reward":
                reward_rows.append(_reward_row(item))
                if item.final:
                    updates.append((item.rollout_id, {"final_reward": float(item.value)}))
            elif kind == "rollout_end":
                updates.append((item["id"], {k: v for k, v in item.items() if k != "id"}))
            else:
                raise ValueError(f"unknown store operation {kind!r}")
        with self.engine.begin() as conn:
            if rollout_rows:
                conn.execute(sa.insert(S.rollouts), rollout_rows)
            if calls:
                self._insert_calls(conn, calls)
            if reward_rows:
                conn.execute(sa.insert(S.rewards), reward_rows)
            for rid, values in updates:
                conn.execute(sa.update(S.rollouts).where(S.rollouts.c.id == rid).values(**values))

    def _insert_calls(self, conn: sa.Connection, calls: Sequence[LLMCall]) -> None:
        """The hot path of ingestion: driver-level bulk insert (COPY on PostgreSQL).

        JSON columns are serialised once here; SQLAlchemy's JSON type reads them
        back on both engines.
        """
        rows = [_call_tuple(c) for c in calls]
        if self.dialect == "postgresql":
            raw = conn.connection.driver_connection
            with raw.cursor() as cur, cur.copy(_COPY_CALLS) as copy:
                copy.set_types(_CALL_PG_TYPES)
                for row in rows:
                    copy.write_row(row)
        else:
            conn.exec_driver_sql(_INSERT_CALLS_QMARK, rows)

    # -- direct writes (gateway, trainer, tests) -----------------------------
    def create_rollout(self, rollout: Rollout) -> tuple[Rollout, bool]:
        """Insert a rollout unless one with that id exists. Returns (stored, created)."""
        existing = self.get_rollout(rollout.id)
        if existing is not None:
            return existing, False
        try:
            with self.engine.begin() as conn:
                conn.execute(sa.insert(S.rollouts), [_rollout_row(rollout)])
        except sa_exc.IntegrityError:  # created concurrently
            found = self.get_rollout(rollout.id)
            assert found is not None
            return found, False
        stored = self.get_rollout(rollout.id)
        assert stored is not None
        return stored, True

    def record_call(self, call: LLMCall) -> None:
        self._apply_ops([("call", call)])

    def add_reward(self, reward: Reward) -> None:
        self._apply_ops([("reward", reward)])

    def finish_rollout(self, rollout_id: str, *, status: str = RolloutStatus.SUCCEEDED.value,
                       error: str | None = None, ended_at: float | None = None) -> Rollout:
        current = self.get_rollout(rollout_id)
        if current is None:
            raise KeyError(rollout_id)
        ended = ended_at or time.time()
        with self.engine.begin() as conn:
            conn.execute(sa.update(S.rollouts).where(S.rollouts.c.id == rollout_id).values(
                status=status, error=error, ended_at=ended, duration_s=max(0.0, ended - current.created_at)))
        done = self.get_rollout(rollout_id)
        assert done is not None
        return done

    def add_policy_version(self, pv: PolicyVersion) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.insert(S.policy_versions), [_policy_row(pv)])

    def claim_rollouts(self, rollout_ids: Iterable[str], trainer_id: str) -> list[str]:
        """Take unconsumed, unclaimed rollouts for `trainer_id`; returns the ids it got.

        Each claim is a conditional UPDATE, so two trainers on one database never
        get the same rollout.
        """
        got: list[str] = []
        with self.engine.begin() as conn:
            for rid in rollout_ids:
                res = conn.execute(
                    sa.update(S.rollouts)
                    .where(S.rollouts.c.id == rid, S.rollouts.c.claimed_by.is_(None),
                           S.rollouts.c.consumed_step.is_(None))
                    .values(claimed_by=trainer_id)
                )
                if res.rowcount == 1:
                    got.append(rid)
        return got

    def release_claims(self, trainer_id: str, rollout_ids: Iterable[str] | None = None) -> int:
        """Give back claimed-but-unconsumed rollouts (all of a trainer's, or just `rollout_ids`).

        A trainer restarting after a crash releases everything it held: the step
        that claimed them never committed, so they were not trained on.
        """
        c = S.rollouts.c
        q = sa.update(S.rollouts).where(c.claimed_by == trainer_id, c.consumed_step.is_(None))
        if rollout_ids is not None:
            q = q.where(c.id.in_(list(rollout_ids)))
        with self.engine.begin() as conn:
            return conn.execute(q.values(claimed_by=None)).rowcount

    def skip_rollouts(self, rollout_ids: Iterable[str], trainer_id: str) -> int:
        """Mark claimed rollouts as consumed without training (step -1): counted, never polled again."""
        c = S.rollouts.c
        ids = list(rollout_ids)
        if not ids:
            return 0
        with self.engine.begin() as conn:
            return conn.execute(
                sa.update(S.rollouts).where(c.id.in_(ids), c.claimed_by == trainer_id, c.consumed_step.is_(None))
                .values(consumed_step=SKIPPED_STEP)
            ).rowcount

    def commit_train_step(self, step: TrainStep, policy_version: PolicyVersion | None = None) -> None:
        """Record a step, its new policy version, and mark its rollouts consumed: one transaction.

        After a crash either all of it happened (the rollouts are consumed and the
        checkpoint is the latest version) or none of it did (the rollouts are
        released at restart and trained from the previous checkpoint).
        """
        with self.engine.begin() as conn:
            conn.execute(sa.insert(S.train_steps), [{
                "step": step.step, "trainer_id": step.trainer_id, "policy_version": step.policy_version,
                "created_at": step.created_at or time.time(), "metrics": step.metrics or None,
                "rollout_ids": list(step.rollout_ids),
            }])
            if policy_version is not None:
                conn.execute(sa.insert(S.policy_versions), [_policy_row(policy_version)])
            if step.rollout_ids:
                conn.execute(
                    sa.update(S.rollouts).where(S.rollouts.c.id.in_(list(step.rollout_ids)))
                    .values(consumed_step=step.step)
                )

    # -- reads (trainer, notebooks) -----------------------------------------
    def get_rollout(self, rollout_id: str) -> Rollout | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(S.rollouts).where(S.rollouts.c.id == rollout_id)).first()
        return None if row is None else _rollout_record(row)

    def query_rollouts(
        self,
        *,
        status: str | Sequence[str] | None = None,
        mode: str | None = None,
        task_id: str | Sequence[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        consumed: bool | None = None,
        claimed: bool | None = None,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[Rollout]:
        """Rollouts filtered by status / mode / task (group) / creation time / consumption."""
        q = sa.select(S.rollouts)
        c = S.rollouts.c
        if status is not None:
            q = q.where(c.status.in_([status] if isinstance(status, str) else list(status)))
        if mode is not None:
            q = q.where(c.mode == mode)
        if task_id is not None:
            q = q.where(c.task_id.in_([task_id] if isinstance(task_id, str) else list(task_id)))
        if since is not None:
            q = q.where(c.created_at >= since)
        if until is not None:
            q = q.where(c.created_at < until)
        if consumed is not None:
            q = q.where(c.consumed_step.is_not(None) if consumed else c.consumed_step.is_(None))
        if claimed is not None:
            q = q.where(c.claimed_by.is_not(None) if claimed else c.claimed_by.is_(None))
        q = q.order_by(c.created_at.desc() if newest_first else c.created_at, c.id)
        if limit is not None:
            q = q.limit(limit)
        with self.engine.connect() as conn:
            return [_rollout_record(r) for r in conn.execute(q)]

    def rollout_groups(self, **filters: Any) -> dict[str, list[Rollout]]:
        """Rollouts (filtered as in `query_rollouts`) grouped by task id, the GRPO group."""
        groups: dict[str, list[Rollout]] = {}
        for r in self.query_rollouts(**filters):
            groups.setdefault(r.task_id, []).append(r)
        return groups

    def calls(self, rollout_id: str | None, *, training_only: bool = False) -> list[LLMCall]:
        """The LLM calls of one rollout in call order (attempts in order). None: unattached calls."""
        return self.calls_for([rollout_id], training_only=training_only).get(rollout_id, [])

    def calls_for(self, rollout_ids: Sequence[str | None], *, training_only: bool = False
                  ) -> dict[str | None, list[LLMCall]]:
        """The calls of many rollouts in one query, keyed by rollout id."""
        c = S.llm_calls.c
        wanted = [r for r in rollout_ids if r is not None]
        conds = []
        if wanted:
            conds.append(c.rollout_id.in_(wanted))
        if None in rollout_ids:
            conds.append(c.rollout_id.is_(None))
        if not conds:
            return {}
        q = sa.select(S.llm_calls).where(sa.or_(*conds))
        if training_only:
            q = q.where(c.is_training.is_(True))
        q = q.order_by(c.rollout_id, c.call_index, c.attempt, c.started_at)
        out: dict[str | None, list[LLMCall]] = {rid: [] for rid in rollout_ids}
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                call = _call_record(row)
                out.setdefault(call.rollout_id, []).append(call)
        return out

    def rewards(self, rollout_id: str) -> list[Reward]:
        q = sa.select(S.rewards).where(S.rewards.c.rollout_id == rollout_id).order_by(S.rewards.c.id)
        with self.engine.connect() as conn:
            return [_reward_record(r) for r in conn.execute(q)]

    def policy_versions(self, trainer_id: str | None = None) -> list[PolicyVersion]:
        """Policy versions in order; only one trainer's lineage if `trainer_id` is given."""
        t = S.policy_versions
        q = sa.select(t).order_by(t.c.version, t.c.id)
        if trainer_id is not None:
            q = q.where(t.c.trainer_id == trainer_id)
        with self.engine.connect() as conn:
            return [PolicyVersion(version=r.version, path=r.path, trainer_id=r.trainer_id, checksum=r.checksum,
                                  created_at=r.created_at, metadata=r.metadata or {}) for r in conn.execute(q)]

    def get_policy_version(self, version: int, trainer_id: str | None = None) -> PolicyVersion | None:
        found = [p for p in self.policy_versions(trainer_id) if p.version == version]
        return found[-1] if found else None

    def latest_policy_version(self, trainer_id: str | None = None) -> int | None:
        t = S.policy_versions
        q = sa.select(sa.func.max(t.c.version))
        if trainer_id is not None:
            q = q.where(t.c.trainer_id == trainer_id)
        with self.engine.connect() as conn:
            return conn.execute(q).scalar()

    def train_steps(self, trainer_id: str | None = None) -> list[TrainStep]:
        q = sa.select(S.train_steps).order_by(S.train_steps.c.id)
        if trainer_id is not None:
            q = q.where(S.train_steps.c.trainer_id == trainer_id)
        with self.engine.connect() as conn:
            return [TrainStep(step=r.step, policy_version=r.policy_version, created_at=r.created_at,
                              metrics=r.metrics or {}, rollout_ids=tuple(r.rollout_ids or ()),
                              trainer_id=r.trainer_id) for r in conn.execute(q)]

    # -- leases (rollout controller) -----------------------------------------
    def heartbeat(self, rollout_ids: Iterable[str], *, owner: str | None = None, at: float | None = None) -> None:
        """Create or refresh the leases of running rollouts (one transaction)."""
        ids = list(rollout_ids)
        if not ids:
            return
        now = at if at is not None else time.time()
        t = S.rollout_leases
        with self.engine.begin() as conn:
            have = set(conn.execute(sa.select(t.c.rollout_id).where(t.c.rollout_id.in_(ids))).scalars())
            if have:
                conn.execute(sa.update(t).where(t.c.rollout_id.in_(list(have))).values(heartbeat_at=now))
            new = [{"rollout_id": rid, "owner": owner, "heartbeat_at": now} for rid in ids if rid not in have]
            if new:
                conn.execute(sa.insert(t), new)

    def release_leases(self, rollout_ids: Iterable[str]) -> None:
        ids = list(rollout_ids)
        if ids:
            with self.engine.begin() as conn:
                conn.execute(sa.delete(S.rollout_leases).where(S.rollout_leases.c.rollout_id.in_(ids)))

    def end_rollout_if_running(self, rollout: Rollout, *, status: str, error: str | None,
                               ended_at: float | None = None) -> bool:
        """End `rollout.id` with `status` unless it already ended; True if this call ended it.

        If the rollout row never reached the store (its process died before the
        writer flushed), it is inserted from `rollout`, already ended.
        """
        ended = ended_at or time.time()
        c = S.rollouts.c
        with self.engine.begin() as conn:
            created = conn.execute(sa.select(c.created_at).where(c.id == rollout.id)).scalar()
            if created is None:
                row = _rollout_row(rollout)
                row.update(status=status, error=error, ended_at=ended,
                           duration_s=max(0.0, ended - (rollout.created_at or ended)))
                conn.execute(sa.insert(S.rollouts), [row])
                return True
            res = conn.execute(sa.update(S.rollouts).where(
                c.id == rollout.id, c.status == RolloutStatus.RUNNING.value).values(
                status=status, error=error, ended_at=ended, duration_s=max(0.0, ended - created)))
            return res.rowcount == 1

    def reap_stale(self, older_than_s: float, *, include_unleased: bool = False,
                   now: float | None = None) -> list[str]:
        """Mark running rollouts whose lease heartbeat is older than `older_than_s` as failed.

        With `include_unleased`, running rollouts that never had a lease (opened
        with `rollout()` outside a controller) and were created before the cutoff
        are failed too. Returns the ids it ended; their leases are dropped.
        """
        now = now if now is not None else time.time()
        cutoff = now - older_than_s
        r, l = S.rollouts.c, S.rollout_leases.c
        with self.engine.begin() as conn:
            stale = set(conn.execute(
                sa.select(r.id).join(S.rollout_leases, l.rollout_id == r.id)
                .where(r.status == RolloutStatus.RUNNING.value, l.heartbeat_at < cutoff)).scalars())
            if include_unleased:
                stale |= set(conn.execute(
                    sa.select(r.id).outerjoin(S.rollout_leases, l.rollout_id == r.id)
                    .where(r.status == RolloutStatus.RUNNING.value, l.rollout_id.is_(None),
                           r.created_at < cutoff)).scalars())
            ended: list[str] = []
            for rid in sorted(stale):
                res = conn.execute(sa.update(S.rollouts).where(
                    r.id == rid, r.status == RolloutStatus.RUNNING.value).values(
                    status=RolloutStatus.FAILED.value, ended_at=now,
                    duration_s=sa.literal(now) - r.created_at,
                    error=f"lease expired: no heartbeat for {older_than_s:g}s (controller or worker lost)"))
                if res.rowcount == 1:
                    ended.append(rid)
            if stale:
                conn.execute(sa.delete(S.rollout_leases).where(l.rollout_id.in_(list(stale))))
        return ended

    # -- evaluation results ---------------------------------------------------
    def add_eval_result(self, result: EvalResult) -> int:
        with self.engine.begin() as conn:
            res = conn.execute(sa.insert(S.eval_results).values(
                name=result.name, step=result.step, policy_version=result.policy_version,
                created_at=result.created_at or time.time(), metrics=result.metrics or None,
                rollout_ids=list(result.rollout_ids)))
            return int(res.inserted_primary_key[0])

    def eval_results(self, name: str | None = None) -> list[EvalResult]:
        """Evaluation records, oldest first (optionally only those named `name`)."""
        q = sa.select(S.eval_results).order_by(S.eval_results.c.created_at, S.eval_results.c.id)
        if name is not None:
            q = q.where(S.eval_results.c.name == name)
        with self.engine.connect() as conn:
            return [EvalResult(id=r.id, name=r.name, step=r.step, policy_version=r.policy_version,
                               created_at=r.created_at, metrics=r.metrics or {},
                               rollout_ids=tuple(r.rollout_ids or ())) for r in conn.execute(q)]

    def count(self, table: str) -> int:
        t = S.metadata.tables[table]
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() or 0)


# --------------------------------------------------------------------------
# Process-wide default store
# --------------------------------------------------------------------------

_default_lock = threading.Lock()
_open_stores: dict[str, TraceStore] = {}


def get_store(store: TraceStore | str | None = None) -> TraceStore:
    """Resolve a store argument: an instance, a URL, or None for the default URL.

    Stores opened by URL are cached per URL so every wrapped client and rollout
    in a process shares one writer thread and one connection pool.
    """
    if isinstance(store, TraceStore):
        return store
    url = store or default_store_url()
    with _default_lock:
        found = _open_stores.get(url)
        if found is None:
            found = _open_stores[url] = TraceStore(url)
        return found
