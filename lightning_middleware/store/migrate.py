"""Bringing a store of an older schema version up to this one, at open.

Only additive steps: the tables a version added come from `create_all`; the nullable columns it
added (`schema.ADDED_COLUMNS`) are added here with `ALTER TABLE ... ADD COLUMN`, which on both
engines changes the table's definition without rewriting its rows, and its indexes
(`schema.ADDED_INDEXES`) with `CREATE INDEX`. Two processes opening the same
old store at once both try: the loser's "column exists" is taken as done. PostgreSQL's storage
parameters (`schema.PG_STORAGE`) are set on every open where they differ: they change how new rows
are stored, not the schema, so they need no version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from lightning_middleware.store import schema as S
from lightning_middleware.store.connect import StoreError

log = logging.getLogger(__name__)


def stored_version(conn: sa.Connection) -> int | None:
    """The schema version a store records (None: none recorded yet, a store being created)."""
    found = conn.execute(sa.select(S.schema_info.c.value).where(S.schema_info.c.key == "version")).scalar()
    return None if found is None else int(found)


def upgrade(engine: sa.Engine, found: int) -> None:
    """Add what versions `found + 1 .. SCHEMA_VERSION` added, then record SCHEMA_VERSION."""
    if found >= S.SCHEMA_VERSION:
        return
    for version in range(found + 1, S.SCHEMA_VERSION + 1):
        for table, column in S.ADDED_COLUMNS.get(version, ()):
            _add_column(engine, S.metadata.tables[table].c[column])
        for name in S.ADDED_INDEXES.get(version, ()):
            _add_index(engine, name)
    with engine.begin() as conn:
        conn.execute(sa.update(S.schema_info).where(S.schema_info.c.key == "version",
                                                    S.schema_info.c.value == str(found))
                     .values(value=str(S.SCHEMA_VERSION)))
    log.info("trace store upgraded from schema version %d to %d", found, S.SCHEMA_VERSION)


def apply_storage_parameters(engine: sa.Engine) -> None:
    """Give PostgreSQL tables the storage parameters `schema.PG_STORAGE` names, where they differ.

    They change how new rows are stored, never what is read, so a user who may not ALTER the table
    gets a warning and a store that works as before."""
    if engine.dialect.name != "postgresql":
        return
    for table, wanted in S.PG_STORAGE.items():
        with engine.connect() as conn:
            options = conn.execute(sa.text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
                                   {"t": table}).scalar() or []
        have = dict(o.split("=", 1) for o in options)
        if all(have.get(k) == str(v) for k, v in wanted.items()):
            continue
        settings = ", ".join(f"{k} = {int(v)}" for k, v in wanted.items())
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(f"ALTER TABLE {engine.dialect.identifier_preparer.quote(table)} SET ({settings})")
        except sa_exc.DBAPIError as exc:
            reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
            log.warning("could not set %s on %s (%s): the store works, ingestion is slower", settings, table, reason)


def _has_column(engine: sa.Engine, table: str, column: str) -> bool:
    return column in {c["name"] for c in sa.inspect(engine).get_columns(table)}


def _has_index(engine: sa.Engine, table: str, name: str) -> bool:
    return name in {i["name"] for i in sa.inspect(engine).get_indexes(table)}


def _add_column(engine: sa.Engine, column: sa.Column) -> None:
    table = column.table.name
    preparer = engine.dialect.identifier_preparer
    kind = column.type.compile(dialect=engine.dialect)
    guard = "IF NOT EXISTS " if engine.dialect.name == "postgresql" else ""
    ddl = f"ALTER TABLE {preparer.quote(table)} ADD COLUMN {guard}{preparer.quote(column.name)} {kind}"

    def add() -> None:
        with engine.begin() as conn:
            conn.exec_driver_sql(ddl)

    _step(f"{table} (add column {column.name})", lambda: _has_column(engine, table, column.name), add)


def _add_index(engine: sa.Engine, name: str) -> None:
    index = next(i for t in S.metadata.tables.values() for i in t.indexes if i.name == name)
    table = index.table
    assert table is not None
    _step(f"{table.name} (create index {name})", lambda: _has_index(engine, table.name, name),
          lambda: index.create(engine))


def _step(what: str, done: Callable[[], bool], run: Callable[[], object]) -> None:
    """Run one additive step unless it is done; two processes may race: the loser's failure,
    with the step done meanwhile, is success."""
    if done():
        return
    try:
        run()
    except sa_exc.DBAPIError as exc:
        if done():  # another process did it meanwhile
            return
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        raise StoreError(f"cannot upgrade the store's table {what}: {reason}; "
                         "open it once with a user allowed to ALTER it") from exc
