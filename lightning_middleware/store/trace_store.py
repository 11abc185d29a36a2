"""The trace store: rollouts, LLM calls, rewards, policy versions, training steps.

One class over SQLAlchemy Core, for SQLite (default, a file in WAL mode) and
PostgreSQL (`postgresql+psycopg://...`). Writes from agents go through a
`BatchWriter` (see writer.py); the trainer, the gateway and notebooks use the
direct methods, each its own short transaction. Reads live in queries.py; reward writes beyond
the writer's in reward_ops.py (with the rule for when a final reward moves `final_reward`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from lightning_middleware.records import EvalResult, LLMCall, PolicyVersion, Reward, Rollout, RolloutStatus
from lightning_middleware.store import mapping as M
from lightning_middleware.store import schema as S
from lightning_middleware.store.checkpoint import Checkpointer
from lightning_middleware.store.connect import (
    StoreError,
    default_store_url,
    is_transient,
    make_engine,
    normalise_url,
    sqlite_file,
)
from lightning_middleware.store.migrate import apply_storage_parameters, stored_version, upgrade
from lightning_middleware.store.queries import StoreQueries
from lightning_middleware.store.reward_ops import RewardOps, set_final_reward
from lightning_middleware.store.training import TrainerOps
from lightning_middleware.store.writer import BatchWriter, Op, WriterStats

log = logging.getLogger(__name__)



class CallSource(Protocol):
    """A call captured but not parsed yet (capture's DeferredCall): parsed on the writer thread."""

    def build(self) -> LLMCall: ...


class TraceStore(StoreQueries, RewardOps, TrainerOps):
    """A trace store at `url` (default: env LIGHTNING_STORE_URL or ./lightning_traces.db).

    Raises StoreError at construction if the database can't be opened, so a bad
    URL fails where it is configured, never inside an agent's LLM call.
    """

    def __init__(self, url: str | None = None, *, create: bool = True, writer_interval_s: float = 0.05,
                 max_buffer: int = 200_000) -> None:
        """`create=False` opens an existing store only (the readers: CLI commands, notebooks): a
        SQLite file that does not exist, or a database without the trace tables, raises
        StoreError, and nothing is created."""
        self.url = normalise_url(url or default_store_url())
        path = sqlite_file(self.url)
        if not create and path is not None and not os.path.exists(path):
            raise StoreError(f"no trace store at {self.safe_url}: file {path!r} does not exist")
        try:
            self.engine = make_engine(self.url)
            if create:
                self._create_schema()
            elif not sa.inspect(self.engine).has_table(S.rollouts.name):
                self.engine.dispose()
                raise StoreError(f"{self.safe_url} has no trace tables (not a lightning-middleware store?)")
            else:  # a reader of an older store: add the columns its queries name (never a table)
                self._check_version()
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
        self._checkpointer: Checkpointer | None = None
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
            if stored_version(conn) is None:
                try:
                    conn.execute(sa.insert(S.schema_info).values(key="version", value=str(S.SCHEMA_VERSION)))
                except sa_exc.IntegrityError:  # another process created it first
                    pass
        self._check_version()
        apply_storage_parameters(self.engine)

    def _check_version(self) -> None:
        """Refuse a store newer than this package; bring an older one up to this version."""
        with self.engine.connect() as conn:
            found = stored_version(conn)
        if found is None:  # a reader racing the store's creation: the creator records the version
            return
        if found > S.SCHEMA_VERSION:
            raise StoreError(
                f"{self.safe_url} has schema version {found}, newer than this lightning-middleware "
                f"({S.SCHEMA_VERSION}); upgrade the package"
            )
        upgrade(self.engine, found)

    # -- background writes (agents) -----------------------------------------
    @property
    def writer(self) -> BatchWriter:
        if self._writer is None:
            with self._writer_lock:
                if self._writer is None:
                    path = sqlite_file(self.url)
                    if path is not None:  # started before the writer: its first batch may kick it
                        self._checkpointer = Checkpointer(path)
                    self._writer = BatchWriter(
                        self._apply_ops, is_transient=is_transient,
                        interval_s=self._writer_interval_s, max_buffer=self._max_buffer,
                    )
        return self._writer

    # Producers hand over records as they are; turning them into rows happens on
    # the writer thread, so an agent's call pays only for an append.
    def submit_rollout(self, rollout: Rollout) -> None:
        self.writer.submit("rollout", rollout)

    def submit_call(self, call: LLMCall | CallSource) -> None:
        """A record, or a captured call whose record is built on the writer thread."""
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
        if self._checkpointer is not None:
            self._checkpointer.close(timeout)
            self._checkpointer = None
        self.engine.dispose()

    def _apply_ops(self, ops: Sequence[Op]) -> None:
        """Apply a batch in one transaction: inserts first, then updates in order.

        A rollout row is always submitted before its calls, rewards and end, so
        doing all inserts of the batch before its updates keeps every update
        after the insert it refers to.
        """
        rollout_rows, calls, reward_rows = [], [], []
        updates: list[tuple[str, dict[str, Any]]] = []  # {"final_reward": x}: under reward_ops' rule
        for kind, item in ops:
            if kind == "call":  # a record, or a captured call still to be parsed (capture._DeferredCall)
                calls.append(item if isinstance(item, LLMCall) else item.build())
            elif kind == "rollout":
                rollout_rows.append(M.rollout_row(item))
            elif kind == "reward":
                reward_rows.append(M.reward_row(item))
                if item.sets_final_reward:
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
                if "final_reward" in values:
                    set_final_reward(conn, rid, values["final_reward"])
                else:  # the first end stands: the controller may have ended it (cancelled, reaped) already
                    conn.execute(sa.update(S.rollouts).where(
                        S.rollouts.c.id == rid, S.rollouts.c.status == RolloutStatus.RUNNING.value).values(**values))
        if self._checkpointer is not None:  # committed: its pages go into the database in the background
            self._checkpointer.kick()

    def _insert_calls(self, conn: sa.Connection, calls: Sequence[LLMCall]) -> None:
        """The hot path of ingestion: driver-level bulk insert (COPY on PostgreSQL).

        JSON columns are serialised once here; SQLAlchemy's JSON type reads them
        back on both engines.
        """
        if self.dialect == "postgresql":
            raw = conn.connection.driver_connection
            assert raw is not None
            with raw.cursor() as cur, cur.copy(M.COPY_CALLS) as copy:
                copy.set_types(M.CALL_PG_TYPES)
                # Each row is built as it is written: the server inserts what psycopg has sent while
                # this thread builds the next rows (built all first, the server idled meanwhile).
                for c in calls:
                    copy.write_row(M.call_tuple(c))
        else:
            conn.exec_driver_sql(M.INSERT_CALLS_QMARK, [M.call_tuple(c) for c in calls])

    # -- direct writes (gateway, trainer, tests) -----------------------------
    def create_rollout(self, rollout: Rollout) -> tuple[Rollout, bool]:
        """Insert a rollout unless one with that id exists. Returns (stored, created)."""
        existing = self.get_rollout(rollout.id)
        if existing is not None:
            return existing, False
        try:
            with self.engine.begin() as conn:
                conn.execute(sa.insert(S.rollouts), [M.rollout_row(rollout)])
        except sa_exc.IntegrityError:  # created concurrently
            found = self.get_rollout(rollout.id)
            assert found is not None
            return found, False
        stored = self.get_rollout(rollout.id)
        assert stored is not None
        return stored, True

    def record_call(self, call: LLMCall) -> None:
        self._apply_ops([("call", call)])

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
            conn.execute(sa.insert(S.policy_versions), [M.policy_row(pv)])

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

    def lease_heartbeats(self, rollout_ids: Iterable[str]) -> dict[str, float]:
        """The last heartbeat of each of these rollouts that has a lease (for `lightning-mw k8s reap`)."""
        ids = list(rollout_ids)
        if not ids:
            return {}
        t = S.rollout_leases
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.rollout_id, t.c.heartbeat_at).where(t.c.rollout_id.in_(ids)))
            return {rid: float(at) for rid, at in rows}

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
                row = M.rollout_row(rollout)
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
        r, lease = S.rollouts.c, S.rollout_leases.c
        with self.engine.begin() as conn:
            stale = set(conn.execute(
                sa.select(r.id).join(S.rollout_leases, lease.rollout_id == r.id)
                .where(r.status == RolloutStatus.RUNNING.value, lease.heartbeat_at < cutoff)).scalars())
            if include_unleased:
                stale |= set(conn.execute(
                    sa.select(r.id).outerjoin(S.rollout_leases, lease.rollout_id == r.id)
                    .where(r.status == RolloutStatus.RUNNING.value, lease.rollout_id.is_(None),
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
                conn.execute(sa.delete(S.rollout_leases).where(lease.rollout_id.in_(list(stale))))
        return ended

    # -- evaluation results ---------------------------------------------------
    def add_eval_result(self, result: EvalResult) -> int:
        with self.engine.begin() as conn:
            res = conn.execute(sa.insert(S.eval_results).values(
                name=result.name, step=result.step, policy_version=result.policy_version,
                created_at=result.created_at or time.time(), metrics=result.metrics or None,
                rollout_ids=list(result.rollout_ids)))
            key = res.inserted_primary_key
            assert key is not None
            return int(key[0])


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


def open_store(store: TraceStore | str | None = None) -> TraceStore:
    """An existing store for reading: an instance as it is, or a URL (None: the default URL)
    opened with `create=False`, so a mistyped path raises StoreError instead of creating an
    empty database."""
    if isinstance(store, TraceStore):
        return store
    return TraceStore(store or default_store_url(), create=False)
