"""The credential scan tests/conftest.py runs on every store the suite writes: it must find what
it is for (in rows, in WAL files, in deleted rows, in PostgreSQL) and nothing in ordinary data.

Stores holding credentials are written outside pytest's temp directory, which conftest scans.
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from lightning_middleware.testing.secret_scan import find_secrets, scan_database, scan_sqlite, scan_tree

KEY = "sk-scanme-3b8f1d2e9a"


@pytest.fixture
def outside() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="secret-scan-") as d:
        yield Path(d)


def _db(path: Path, *values: str, encoding: str = "UTF-8", wal: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"PRAGMA encoding = '{encoding}'")
    if wal:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("CREATE TABLE t (v TEXT)")
    conn.executemany("INSERT INTO t VALUES (?)", [(v,) for v in values])
    return conn


def test_patterns_match_credentials_and_not_ordinary_text() -> None:
    for secret in (KEY, "Bearer abc.DEF-123", '"Authorization": "Basic dXNlcjpwYXNz"', '"api_key":"k"',
                   '{"X-Api-Key": "anything"}'):
        assert find_secrets(f"before {secret} after".encode()), secret
    for text in ("task-abcdefghijkl", "disk-0123456789", "sk-short", "missing or wrong bearer token",
                 "(Authorization: Bearer <token>)", '"properties": {"api_key": {"type": "string"}}',
                 "echo: what is 2+2?"):
        assert find_secrets(text.encode()) == [], text
    assert find_secrets(b"the value s3cr3t-value", known=[b"s3cr3t-value"]) == ["s3cr3t-value"]
    assert find_secrets(b"the value s3cr3t-value") == []


def test_a_clean_store_has_no_findings(outside: Path) -> None:
    _db(outside / "clean.db", "echo: what is 2+2?", '{"model": "m", "messages": []}').close()
    assert scan_tree(outside) == []


def test_rows_are_read_as_text_not_only_as_file_bytes(outside: Path) -> None:
    # UTF-16 text has no ASCII key in the file's bytes: only reading the rows finds it.
    _db(outside / "utf16.db", f"key {KEY}", encoding="UTF-16le").close()
    assert [(f.where, f.match) for f in scan_tree(outside)] == [(f"{outside / 'utf16.db'} (rows)", KEY)]


def test_wal_frames_and_deleted_rows_are_scanned(outside: Path) -> None:
    conn = _db(outside / "wal.db", f'{{"authorization": "Bearer {KEY}"}}', wal=True)  # left in the WAL
    assert {Path(f.where.removesuffix(" (rows)")).name for f in scan_tree(outside)} == {"wal.db", "wal.db-wal"}
    conn.close()
    deleted = _db(outside / "deleted.db", KEY, "kept")
    deleted.execute("PRAGMA secure_delete = OFF")  # the row's bytes stay in the file after the delete
    deleted.execute("DELETE FROM t WHERE v != 'kept'")
    deleted.close()
    assert [f.where for f in scan_sqlite(outside / "deleted.db")] == [str(outside / "deleted.db")]  # bytes only


def test_unchanged_files_are_scanned_once(outside: Path) -> None:
    conn = _db(outside / "a.db", KEY)
    seen: dict[Path, tuple[int, int]] = {}
    assert scan_tree(outside, seen=seen) and scan_tree(outside, seen=seen) == []
    conn.execute("INSERT INTO t VALUES (?)", ("x" * 10_000,))
    conn.close()
    assert scan_tree(outside, seen=seen)  # written since: scanned again


def test_postgres_tables_are_scanned(pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE calls (request JSON, note TEXT)"))
        conn.execute(sa.text("INSERT INTO calls VALUES (CAST(:r AS JSON), 'fine')"),
                     {"r": '{"model": "m", "api_key": "k-123"}'})
    try:
        assert [f.match for f in scan_database(pg_url)] == ['"api_key": "k-123"']
        assert scan_database(pg_url, known=[b"fine"])[-1].match == "fine"
    finally:
        with engine.begin() as conn:  # the fixture scans the database too: leave it clean
            conn.execute(sa.text("DROP TABLE calls"))
        engine.dispose()
    assert scan_database(pg_url) == []
