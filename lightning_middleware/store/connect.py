"""Store URLs and database engines: SQLite (a WAL file) or PostgreSQL through SQLAlchemy."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import StaticPool

from lightning_middleware import fastjson
from lightning_middleware.errors import UsageError

DEFAULT_URL = "sqlite:///./lightning_traces.db"
ENV_URL = "LIGHTNING_STORE_URL"


class StoreError(UsageError, RuntimeError):
    """The store could not be opened or used; the message says what to fix."""


def default_store_url() -> str:
    return os.environ.get(ENV_URL) or DEFAULT_URL


def normalise_url(url: str) -> sa.URL:
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


_JSON_CODEC = {"json_serializer": fastjson.dumps_stored, "json_deserializer": fastjson.loads}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # Large pages: a span (~1-3 KB of JSON and packed tokens) fits in one page instead of
    # spilling to overflow pages; inserts run ~1.5x faster. Only takes effect on a new file.
    cur.execute("PRAGMA page_size=16384")
    cur.execute("PRAGMA journal_mode=WAL")  # readers work while the writer writes
    cur.execute("PRAGMA synchronous=NORMAL")  # a process crash loses nothing committed
    # 8192 pages (128 MiB of WAL at 16 KiB pages) before a commit checkpoints inline: a full writer
    # batch (5,000 spans, ~17 MiB) fits, so the writer's background checkpointer does the copying
    # (store/checkpoint.py); at the default 1000 every large batch paid for it on the writer thread.
    cur.execute("PRAGMA wal_autocheckpoint=8192")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def sqlite_file(url: sa.URL) -> str | None:
    """The file of a SQLite URL (None for in-memory databases and other engines)."""
    if url.drivername.startswith("sqlite") and url.database not in (None, "", ":memory:"):
        return url.database
    return None


def make_engine(url: sa.URL) -> sa.Engine:
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


def is_transient(exc: BaseException) -> bool:
    """Database unavailable (retry later) versus a bad operation (reject it)."""
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)
