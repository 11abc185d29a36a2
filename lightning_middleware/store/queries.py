"""The store's reads: what the trainer, the controller, the CLI and notebooks query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from lightning_middleware.records import EvalResult, LLMCall, PolicyVersion, Reward, Rollout, TrainStep
from lightning_middleware.store import mapping as M
from lightning_middleware.store import schema as S


class StoreQueries:
    """Read methods of `TraceStore` (a mixin: each method runs one query on `self.engine`)."""

    engine: sa.Engine

    def get_rollout(self, rollout_id: str) -> Rollout | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(S.rollouts).where(S.rollouts.c.id == rollout_id)).first()
        return None if row is None else M.rollout_record(row)

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
            return [M.rollout_record(r) for r in conn.execute(q)]

    def rollout_groups(self, **filters: Any) -> dict[str, list[Rollout]]:
        """Rollouts (filtered as in `query_rollouts`) grouped by task id, the GRPO group."""
        groups: dict[str, list[Rollout]] = {}
        for r in self.query_rollouts(**filters):
            groups.setdefault(r.task_id, []).append(r)
        return groups

    def get_call(self, call_id: str) -> LLMCall | None:
        """One recorded call by its id (e.g. the call behind a translated `resp_<id>` answer)."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(S.llm_calls).where(S.llm_calls.c.id == call_id)).first()
        return None if row is None else M.call_record(row)

    def keyed_call(self, rollout_id: str | None, key: str) -> LLMCall | None:
        """The first answered attempt of a call sent with this Idempotency-Key in this rollout
        (None: unattached calls), or None: a complete 2xx answer; a failed or cut attempt is
        never replayed, its retry goes upstream."""
        c = S.llm_calls.c
        where = [c.idempotency_key == key, c.status_code >= 200, c.status_code < 300, c.partial.is_(False),
                 c.error.is_(None), c.rollout_id.is_(None) if rollout_id is None else c.rollout_id == rollout_id]
        q = sa.select(S.llm_calls).where(*where).order_by(c.started_at).limit(1)
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
        return None if row is None else M.call_record(row)

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
                call = M.call_record(row)
                out.setdefault(call.rollout_id, []).append(call)
        return out

    def rewards(self, rollout_id: str) -> list[Reward]:
        q = sa.select(S.rewards).where(S.rewards.c.rollout_id == rollout_id).order_by(S.rewards.c.id)
        with self.engine.connect() as conn:
            return [M.reward_record(r) for r in conn.execute(q)]

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
