"""What a trainer daemon does to the store: claim rollouts, give back or skip them, commit a
step, and hold the lease that makes it the one live run of its trainer id."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from lightning_middleware.records import Event, PolicyVersion, TrainStep
from lightning_middleware.store import mapping as M
from lightning_middleware.store import schema as S
from lightning_middleware.store.connect import StoreError

SKIPPED_STEP = -1  # rollouts.consumed_step of rollouts a trainer took but did not train on
TRAINER_LEASE_S = 60.0  # a run whose heartbeat is older than this is taken to be dead


class TrainerIdInUse(StoreError):
    """Another live daemon runs under this trainer id (two would release each other's claims)."""


class LeaseLost(StoreError):
    """This run no longer holds its trainer id's lease: its step was not committed."""


def new_run_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _alive(run_id: str) -> bool:
    """False only when `run_id` names a process on this host that no longer exists."""
    host, _, rest = run_id.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's run: only its heartbeat can tell
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TrainerOps:
    """Trainer-side writes of `TraceStore` (a mixin over `self.engine`)."""

    engine: sa.Engine

    # -- the trainer-id lease ------------------------------------------------
    def acquire_trainer(self, trainer_id: str, *, lease_s: float = TRAINER_LEASE_S,
                        run_id: str | None = None) -> str:
        """Make this run the live one of `trainer_id`; returns its run id ("host:pid:random").

        Refused (TrainerIdInUse) while another run of the same id is alive: two daemons under
        one id would each release the other's claims at start and train a batch twice. A run
        is dead when its heartbeat is older than `lease_s`, or at once when it ran on this host
        and its process is gone (a restart after kill -9 need not wait out the lease).
        """
        run_id = run_id or new_run_id()
        t = S.trainer_leases
        for _ in range(3):  # a concurrent first insert: retry to read the winner
            now = time.time()
            try:
                with self.engine.begin() as conn:
                    row = conn.execute(sa.select(t).where(t.c.trainer_id == trainer_id).with_for_update()).first()
                    if row is None:
                        conn.execute(sa.insert(t).values(trainer_id=trainer_id, run_id=run_id, started_at=now,
                                                         heartbeat_at=now))
                        return run_id
                    if row.run_id != run_id and now - row.heartbeat_at < lease_s and _alive(row.run_id):
                        raise TrainerIdInUse(
                            f"trainer id {trainer_id!r} is in use by a running daemon (run {row.run_id}, "
                            f"heartbeat {now - row.heartbeat_at:.0f}s ago): give this one another --trainer-id, "
                            f"or stop the other (its lease expires {lease_s:g}s after its last heartbeat)")
                    # Compare-and-set on what was read: SQLite ignores FOR UPDATE, so another run may
                    # have taken the lease since; then this update matches nothing and we read again.
                    taken = conn.execute(sa.update(t).where(
                        t.c.trainer_id == trainer_id, t.c.run_id == row.run_id, t.c.heartbeat_at == row.heartbeat_at
                    ).values(run_id=run_id, started_at=now, heartbeat_at=now))
                    if taken.rowcount == 1:
                        return run_id
            except sa_exc.IntegrityError:
                continue
        raise TrainerIdInUse(f"could not take the lease of trainer id {trainer_id!r}")

    def trainer_heartbeat(self, trainer_id: str, run_id: str) -> None:
        """Refresh the lease; LeaseLost if another run has taken it over."""
        with self.engine.begin() as conn:
            self._hold(conn, trainer_id, run_id)

    def release_trainer(self, trainer_id: str, run_id: str) -> None:
        """End the lease (a clean stop: the next daemon of this id may start at once)."""
        t = S.trainer_leases
        with self.engine.begin() as conn:
            conn.execute(sa.delete(t).where(t.c.trainer_id == trainer_id, t.c.run_id == run_id))

    @staticmethod
    def _hold(conn: sa.Connection, trainer_id: str, run_id: str) -> None:
        t = S.trainer_leases
        res = conn.execute(sa.update(t).where(t.c.trainer_id == trainer_id, t.c.run_id == run_id)
                           .values(heartbeat_at=time.time()))
        if res.rowcount != 1:
            raise LeaseLost(f"run {run_id} of trainer {trainer_id!r} lost its lease to another run")

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

    def commit_train_step(self, step: TrainStep, policy_version: PolicyVersion | None = None, *,
                          run_id: str | None = None) -> None:
        """Record a step, its new policy version, and mark its rollouts consumed: one transaction.

        After a crash either all of it happened (the rollouts are consumed and the
        checkpoint is the latest version) or none of it did (the rollouts are
        released at restart and trained from the previous checkpoint).

        With `run_id`, the same transaction checks that the run still holds its trainer id's
        lease and that every rollout is still claimed by `step.trainer_id` and unconsumed;
        otherwise nothing is written (LeaseLost): no rollout is trained into two lineages.
        """
        with self.engine.begin() as conn:
            if run_id is not None and step.trainer_id is not None:
                self._hold(conn, step.trainer_id, run_id)
                c = S.rollouts.c
                ids = list(step.rollout_ids)
                held = conn.execute(sa.select(sa.func.count()).select_from(S.rollouts).where(
                    c.id.in_(ids), c.claimed_by == step.trainer_id, c.consumed_step.is_(None))).scalar()
                if held != len(set(ids)):
                    raise LeaseLost(f"{len(set(ids)) - (held or 0)} of the step's rollouts are no longer "
                                    f"claimed by {step.trainer_id!r}: the step is not committed")
            conn.execute(sa.insert(S.train_steps), [{
                "step": step.step, "trainer_id": step.trainer_id, "policy_version": step.policy_version,
                "created_at": step.created_at or time.time(), "metrics": step.metrics or None,
                "rollout_ids": list(step.rollout_ids),
            }])
            if policy_version is not None:
                conn.execute(sa.insert(S.policy_versions), [M.policy_row(policy_version)])
            if step.rollout_ids:
                conn.execute(
                    sa.update(S.rollouts).where(S.rollouts.c.id.in_(list(step.rollout_ids)))
                    .values(consumed_step=step.step)
                )

    # -- events ------------------------------------------------------------------
    def add_event(self, event: Event) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.insert(S.events).values(
                created_at=event.created_at or time.time(), kind=event.kind, source=event.source, step=event.step,
                message=event.message, data=event.data or None))

    def events(self, kind: str | None = None, source: str | None = None) -> list[Event]:
        """Events, oldest first (optionally one kind, one source)."""
        t = S.events
        q = sa.select(t).order_by(t.c.id)
        if kind is not None:
            q = q.where(t.c.kind == kind)
        if source is not None:
            q = q.where(t.c.source == source)
        with self.engine.connect() as conn:
            return [Event(id=r.id, created_at=r.created_at, kind=r.kind, source=r.source, step=r.step,
                          message=r.message, data=r.data or {}) for r in conn.execute(q)]
