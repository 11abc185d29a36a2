"""The trace store's schema: one SQLAlchemy Core schema for SQLite and PostgreSQL.

Timestamps are float seconds since the epoch (portable across both engines and
cheap to compare). Token IDs and logprobs are packed binary (see `codec`): choice 0's in
their columns; those of the other choices of a request with n > 1 packed the same way inside the
response JSON (`mapping.EXTRA_CHOICES_KEY`), so that needed no new column or schema version.
`llm_calls.rollout_id` has no foreign key on purpose: calls can arrive before the
rollout row (another process, the `x-rollout-id` header) or belong to no rollout.

Versions: `SCHEMA_VERSION` is written to `schema_info` when a store is created. A later version
adds tables (`create_all` gives an existing store the missing ones) or nullable columns, listed in
`ADDED_COLUMNS` by the version that added them; `migrate.upgrade` adds those to an older store
when it is opened, and raises the stored version. No change rewrites or drops existing rows.
"""

from __future__ import annotations

import sqlalchemy as sa

SCHEMA_VERSION = 3

# (table, column) added by each version after 1; the columns are nullable, so adding one to a
# full table rewrites no row and older readers' queries (which name their columns) still work.
ADDED_COLUMNS: dict[int, tuple[tuple[str, str], ...]] = {
    2: (("rewards", "call_index"), ("rewards", "config_hash"), ("rewards", "agent")),
    3: (("llm_calls", "idempotency_key"),),
}
# Indexes added by each version on tables an older store already has (`create_all` creates a
# missing table's indexes, never a missing index of an existing table).
ADDED_INDEXES: dict[int, tuple[str, ...]] = {
    3: ("ix_llm_calls_idempotency",),
}

# PostgreSQL storage parameters by table, set when a store is opened (migrate.apply_storage_parameters;
# SQLAlchemy 2.0 has no table option for them). A span's row (~3.5 KB: packed token IDs, request and
# response JSON) passes PostgreSQL's default TOAST threshold (~2 KB), so every insert tried pglz on its
# columns (random token IDs don't compress) and moved them to the TOAST table with its own index:
# half of the server's CPU per span. Up to 8,160 bytes a row now stays inline, uncompressed;
# longer rows are TOASTed as before. docs/benchmarks.md, "Store ingestion", has the figures.
PG_STORAGE: dict[str, dict[str, int]] = {"llm_calls": {"toast_tuple_target": 8160}}

metadata = sa.MetaData()

rollouts = sa.Table(
    "rollouts",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("task_id", sa.String(255), nullable=False, index=True),
    sa.Column("mode", sa.String(16), nullable=False, server_default="train"),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("input", sa.JSON, nullable=True),
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.Column("final_reward", sa.Float, nullable=True),
    sa.Column("policy_version", sa.Integer, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("ended_at", sa.Float, nullable=True),
    sa.Column("duration_s", sa.Float, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("claimed_by", sa.String(128), nullable=True),
    sa.Column("consumed_step", sa.Integer, nullable=True, index=True),
)

llm_calls = sa.Table(
    "llm_calls",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("rollout_id", sa.String(64), nullable=True),
    sa.Column("call_index", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False, server_default="1"),
    sa.Column("endpoint", sa.String(32), nullable=False),
    sa.Column("model", sa.String(255), nullable=True),
    sa.Column("agent_name", sa.String(255), nullable=True),
    sa.Column("request", sa.JSON, nullable=True),
    sa.Column("response", sa.JSON, nullable=True),
    sa.Column("prompt_token_ids", sa.LargeBinary, nullable=True),
    sa.Column("completion_token_ids", sa.LargeBinary, nullable=True),
    sa.Column("logprobs", sa.LargeBinary, nullable=True),
    sa.Column("finish_reason", sa.String(32), nullable=True),
    sa.Column("status_code", sa.Integer, nullable=True),
    sa.Column("stream", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("partial", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("is_training", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("latency_s", sa.Float, nullable=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=True),
    sa.Column("request_hash", sa.String(64), nullable=True),
    # Version 3: the caller's `Idempotency-Key`, so that a retry reaching a restarted gateway, or
    # another replica on the same store, is answered from this record instead of sampled again.
    sa.Column("idempotency_key", sa.String(255), nullable=True),
    sa.Index("ix_llm_calls_rollout", "rollout_id", "call_index"),
    sa.Index("ix_llm_calls_idempotency", "idempotency_key"),
)

rewards = sa.Table(
    "rewards",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("rollout_id", sa.String(64), nullable=False, index=True),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("name", sa.String(255), nullable=True),
    sa.Column("final", sa.Boolean, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("metadata", sa.JSON, nullable=True),
    # Version 2: the call (turn) a per-step reward belongs to (NULL: the whole rollout), and the
    # hash of the reward configuration a component or combined final reward was computed under
    # (NULL: reported as it is, by the agent or a person); the agent of a multi-agent rollout a
    # per-agent reward is for (NULL: the rollout as a whole).
    sa.Column("call_index", sa.Integer, nullable=True),
    sa.Column("config_hash", sa.String(64), nullable=True),
    sa.Column("agent", sa.String(128), nullable=True),
)

policy_versions = sa.Table(
    "policy_versions",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("version", sa.Integer, nullable=False),
    # Which trainer's lineage: two trainers on one store each number their own versions.
    sa.Column("trainer_id", sa.String(128), nullable=True),
    sa.Column("path", sa.Text, nullable=True),
    sa.Column("checksum", sa.String(128), nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.UniqueConstraint("trainer_id", "version", name="uq_policy_versions_lineage"),
)

train_steps = sa.Table(
    "train_steps",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("step", sa.Integer, nullable=False, index=True),
    sa.Column("trainer_id", sa.String(128), nullable=True),
    sa.Column("policy_version", sa.Integer, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("metrics", sa.JSON, nullable=True),
    sa.Column("rollout_ids", sa.JSON, nullable=True),
)

# Rollout controller (controller.py): a lease per rollout a controller is running.
# The controller refreshes heartbeat_at while the rollout runs; `reap_stale` marks
# running rollouts whose heartbeat stopped (controller or worker lost) as failed.
# A separate table (not a column) so existing stores gain it via create_all.
rollout_leases = sa.Table(
    "rollout_leases",
    metadata,
    sa.Column("rollout_id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(255), nullable=True),
    sa.Column("heartbeat_at", sa.Float, nullable=False, index=True),
)

# Trainer daemons (store/training.py): one live run per trainer id. A daemon takes the lease
# at start (refused while another run's heartbeat is fresh), refreshes it while it runs, and a
# step commits only in the same transaction as a check that the run still holds it.
trainer_leases = sa.Table(
    "trainer_leases",
    metadata,
    sa.Column("trainer_id", sa.String(128), primary_key=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("heartbeat_at", sa.Float, nullable=False),
)

# Evaluation (evaluation.py): one row per evaluation of a held-out task set.
eval_results = sa.Table(
    "eval_results",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(128), nullable=False, server_default="val", index=True),
    sa.Column("step", sa.Integer, nullable=True),
    sa.Column("policy_version", sa.Integer, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("metrics", sa.JSON, nullable=True),
    sa.Column("rollout_ids", sa.JSON, nullable=True),
)

# Events (store/training.py): what a trainer noticed and warned about (health checks), for
# notebooks and operators; one row each, never read back by the trainer.
events = sa.Table(
    "events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("kind", sa.String(64), nullable=False, index=True),
    sa.Column("source", sa.String(128), nullable=True),
    sa.Column("step", sa.Integer, nullable=True),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("data", sa.JSON, nullable=True),
)

schema_info = sa.Table(
    "schema_info",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(255), nullable=False),
)
