"""Looking for credentials in trace stores: API keys (`sk-...`), Authorization values (`Bearer ...`),
credential fields kept in stored JSON, and any exact values the caller knows were used.

The test suite runs it on every store it writes (tests/conftest.py); it also audits a store:

    findings = scan_sqlite(Path("traces.db"), known=[b"my-gateway-token"])
    findings = scan_database("postgresql+psycopg://trainer@db/traces")

A SQLite file is read twice: its raw bytes (deleted rows and WAL frames included) and its rows
through SQLite (a long value spans pages, and a page boundary can split a key in the raw bytes).
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SECRET_PATTERNS = (
    re.compile(rb"(?<![A-Za-z0-9])sk-[A-Za-z0-9_\-]{8,}"),  # OpenAI-style API keys
    re.compile(rb"\bBearer\s+[A-Za-z0-9\-._~+/]+=*"),  # an Authorization header's value
    # a credential kept as a JSON field (a header dict, a request body)
    re.compile(rb'(?i)"(?:authorization|proxy-authorization|x-api-key|api[_-]?key)"\s*:\s*"[^"]+"'),
)
SQLITE_MAGIC = b"SQLite format 3\x00"
COMPANIONS = ("-wal", "-journal")  # what SQLite writes next to a database
MAX_MATCHES = 5


@dataclass(frozen=True)
class Finding:
    """A credential-looking value in a store: where (a file, or a database's table) and what."""

    where: str
    match: str

    def __str__(self) -> str:
        return f"{self.where}: {self.match!r}"


def find_secrets(data: bytes, known: Collection[bytes] = ()) -> list[str]:
    """The credential-looking values in `data` (each once, at most a few): pattern matches and
    known values."""
    found: dict[str, None] = {}
    for pattern in SECRET_PATTERNS:
        for m in pattern.finditer(data):
            found[m.group().decode("latin-1")] = None
            if len(found) >= MAX_MATCHES:
                return list(found)
    for value in known:
        if data.find(value) >= 0:
            found[value.decode("latin-1")] = None
    return list(found)[:MAX_MATCHES]


def is_store_file(path: Path) -> bool:
    """A SQLite database, or the WAL/journal file SQLite keeps next to one."""
    if path.name.endswith(COMPANIONS):
        return True
    try:
        with path.open("rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def store_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and is_store_file(path):
            yield path


def scan_sqlite(path: Path, known: Collection[bytes] = ()) -> list[Finding]:
    """Findings in one SQLite file's raw bytes and (for a database, not a WAL file) its rows."""
    found = [Finding(str(path), m) for m in _raw_secrets(path, known)]
    if not path.name.endswith(COMPANIONS):
        raw = {f.match for f in found}
        found += [Finding(f"{path} (rows)", m) for m in find_secrets(_sqlite_rows(path), known) if m not in raw]
    return found


def scan_tree(root: Path, known: Collection[bytes] = (),
              seen: dict[Path, tuple[int, int]] | None = None) -> list[Finding]:
    """Findings in every SQLite file under `root`; files in `seen` unchanged since are skipped."""
    found: list[Finding] = []
    for path in store_files(root):
        st = path.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        if seen is not None:
            if seen.get(path) == stamp:
                continue
            seen[path] = stamp
        found += scan_sqlite(path, known)
    return found


def scan_database(url: str, known: Collection[bytes] = ()) -> list[Finding]:
    """Findings in every table of a database (any SQLAlchemy URL, e.g. a PostgreSQL store)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    # PostgreSQL renders each row as JSON text (JSON columns as written, not as Python reprs).
    select = 'SELECT to_jsonb(t)::text FROM "{}" t' if engine.dialect.name == "postgresql" else 'SELECT * FROM "{}"'
    try:
        found: list[Finding] = []
        with engine.connect() as conn:
            for table in sa.inspect(conn).get_table_names():
                rows = conn.execute(sa.text(select.format(table))).all()
                found += [Finding(f"{engine.url.database}.{table}", m) for m in find_secrets(_joined(rows), known)]
        return found
    finally:
        engine.dispose()


def _raw_secrets(path: Path, known: Collection[bytes]) -> list[str]:
    try:  # read, not mmap: a file another process truncates under a map is a SIGBUS
        data = path.read_bytes()
    except OSError as exc:
        log.warning("could not read %s: %s", path, exc)
        return []
    return find_secrets(data, known)


def _sqlite_rows(path: Path) -> bytes:
    """Every row of every table, as bytes (read-only; a database being written is fine)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as exc:
        log.warning("could not open %s: %s", path, exc)
        return b""
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return b"\n".join(_joined(conn.execute(f'SELECT * FROM "{t}"').fetchall()) for t in tables)
    except sqlite3.Error as exc:
        log.warning("could not read the rows of %s: %s", path, exc)
        return b""
    finally:
        conn.close()


def _joined(rows: Iterable[Iterable[object]]) -> bytes:
    return b"\n".join(_as_bytes(v) for row in rows for v in row)


def _as_bytes(value: object) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return str(value).encode("utf-8", "replace")
