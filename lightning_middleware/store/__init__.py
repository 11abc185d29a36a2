"""The trace store: rollouts, LLM calls, rewards, policy versions, train steps and evaluations,
in SQLite (default) or PostgreSQL.

    store = get_store("sqlite:///traces.db")   # writers: created if missing, one per URL per process
    store = open_store("sqlite:///traces.db")  # readers: must exist, never created
"""

from lightning_middleware.store.connect import DEFAULT_URL, ENV_URL, StoreError, default_store_url
from lightning_middleware.store.trace_store import TraceStore, get_store, open_store
from lightning_middleware.store.training import SKIPPED_STEP, LeaseLost, TrainerIdInUse
from lightning_middleware.store.writer import WriterStats

__all__ = [
    "DEFAULT_URL",
    "ENV_URL",
    "LeaseLost",
    "SKIPPED_STEP",
    "StoreError",
    "TraceStore",
    "TrainerIdInUse",
    "WriterStats",
    "default_store_url",
    "get_store",
    "open_store",
]
