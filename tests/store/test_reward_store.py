"""Schema version 2 (per-step and configured rewards) and the final-reward rule, on SQLite and
PostgreSQL: a version-1 store opens, gains the new columns and keeps its rows; a late final
reward is stored but leaves a claimed or consumed rollout's final reward alone."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from lightning_middleware import Reward, Rollout, RolloutStatus, StoreError, TraceStore, TrainStep
from lightning_middleware.store import open_store
from lightning_middleware.store import schema as S


def _version_1_store(url: str) -> None:
    """A store as version 1 made it: every table, `rewards` without call_index / config_hash."""
    old = sa.MetaData()
    for table in S.metadata.tables.values():
        if table.name != "rewards":
            table.to_metadata(old)
    added = {c for _, c in S.ADDED_COLUMNS[2]}
    sa.Table("rewards", old, *[sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable,
                                         index=c.index, autoincrement=c.autoincrement)
                               for c in S.rewards.columns if c.name not in added])
    engine = sa.create_engine(url)
    old.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(old.tables["schema_info"]).values(key="version", value="1"))
        conn.execute(sa.insert(old.tables["rollouts"]).values(id="old", task_id="t", mode="train", status="succeeded",
                                                              final_reward=0.5, created_at=1.0))
        conn.execute(sa.insert(old.tables["rewards"]).values(rollout_id="old", value=0.5, name=None, final=True,
                                                             created_at=1.0, metadata={"by": "agent"}))
    engine.dispose()


def _columns(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return {c["name"] for c in sa.inspect(engine).get_columns("rewards")}
    finally:
        engine.dispose()


@pytest.mark.parametrize("opener", ["writer", "reader"])
def test_a_version_1_store_is_upgraded_and_keeps_its_rows(store_url: str, opener: str) -> None:
    _version_1_store(store_url)
    assert "call_index" not in _columns(store_url)
    store = TraceStore(store_url) if opener == "writer" else open_store(store_url)
    try:
        assert {"call_index", "config_hash", "agent"} <= _columns(store_url)
        with store.engine.connect() as conn:
            assert conn.execute(sa.select(S.schema_info.c.value)).scalar() == str(S.SCHEMA_VERSION)
        [old] = store.rewards("old")
        assert (old.value, old.final, old.metadata, old.call_index, old.config_hash) == (0.5, True, {"by": "agent"},
                                                                                          None, None)
        store.add_rewards([Reward("old", 0.25, name="step", final=False, call_index=0),
                           Reward("old", 0.75, name="final", config_hash="abc")])
        assert store.step_rewards(["old"]) == {"old": {0: 0.25}}
        assert store.get_rollout("old").final_reward == 0.75
    finally:
        store.close()
    again = TraceStore(store_url)  # a second open finds version 2: nothing to do
    assert len(again.rewards("old")) == 3
    again.close()


def test_a_store_newer_than_the_package_is_refused(store_url: str) -> None:
    TraceStore(store_url).close()
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(sa.update(S.schema_info).values(value=str(S.SCHEMA_VERSION + 1)))
    engine.dispose()
    for opener in (TraceStore, open_store):
        with pytest.raises(StoreError, match="newer than this lightning-middleware"):
            opener(store_url)


def test_a_late_final_reward_is_kept_but_moves_no_claimed_or_consumed_rollout(store: TraceStore) -> None:
    for rid in ("free", "claimed", "consumed"):
        store.create_rollout(Rollout(id=rid, task_id="t", status=RolloutStatus.SUCCEEDED, created_at=1.0))
        store.add_reward(Reward(rid, 1.0))
    store.claim_rollouts(["claimed", "consumed"], "trainer0")
    store.commit_train_step(TrainStep(step=1, rollout_ids=("consumed",), trainer_id="trainer0"))
    applied = {rid: store.add_reward(Reward(rid, 0.0, metadata={"late": True})) for rid in ("free", "claimed",
                                                                                           "consumed")}
    assert applied == {"free": True, "claimed": False, "consumed": False}
    assert [store.get_rollout(r).final_reward for r in ("free", "claimed", "consumed")] == [0.0, 1.0, 1.0]
    assert all(len(store.rewards(r)) == 2 for r in ("free", "claimed", "consumed"))  # nothing thrown away
    # The background writer follows the same rule.
    store.submit_reward(Reward("consumed", -1.0))
    assert store.flush()
    assert store.get_rollout("consumed").final_reward == 1.0 and len(store.rewards("consumed")) == 3
    # Forcing (re-scoring with --apply all) moves it; the old rewards stay.
    assert store.add_rewards([Reward("consumed", 2.0)], force_final=True) == {"consumed"}
    assert store.get_rollout("consumed").final_reward == 2.0 and len(store.rewards("consumed")) == 4


def test_a_per_step_reward_cannot_be_final() -> None:
    with pytest.raises(ValueError, match="per-step"):
        Reward("r", 1.0, call_index=2)
