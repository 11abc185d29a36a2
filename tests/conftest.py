"""Shared fixtures: one test LLM server and one PostgreSQL server per session.

Every store-touching test runs on SQLite and on a real PostgreSQL server. The
server is started here from the Debian `postgresql` package (or taken from
LIGHTNING_TEST_PG_URL); if neither is available the PostgreSQL cases fail
with a message saying what to install, they are not skipped.

No store the suite writes may hold a credential: after each test, the SQLite files under
its `tmp_path` are scanned (`testing.secret_scan`: `sk-...` keys, `Bearer ...` values,
credential fields in stored JSON, and every key/token literal the tests' sources use);
each `pg_url` database is scanned before it is dropped; and at the end of the session
every SQLite file under pytest's base temp directory that was not scanned yet. A finding
fails the test (or the session) with the file and the match.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from lightning_middleware import TraceStore
from lightning_middleware.testing import LLMTestServer, PostgresTestServer
from lightning_middleware.testing.secret_scan import Finding, scan_database, scan_tree

# tests.fixtures_vllm: one real vLLM CPU server per session, for the tests that ask;
# tests.leaks: the run fails if a test leaves a thread, a child process or a server running;
# tests.strict: with LIGHTNING_TEST_REQUIRE_ALL=1 (scripts/test.sh) a skip for a missing module fails;
# tests.workers: which tests share a pytest-xdist worker, and the check that they do
pytest_plugins = ["tests.fixtures_vllm", "tests.leaks", "tests.strict", "tests.workers"]

# A key or token literal in a test's source (`api_key="..."`, `token = "..."`, `"Bearer ..."`);
# placeholders (shorter than 6 characters, or one lower-case word like "unused") are left out.
_CREDENTIAL_LITERAL = re.compile(r"""\b(?:upstream_api_key|api[_-]key|token|secret|password)["']?\s*[=:]\s*"""
                                 r"""["']([^"'\s]{6,})["']|\bBearer ([^"'\s{}<>]{6,})""")


def _test_credentials() -> frozenset[bytes]:
    found: set[bytes] = set()
    for path in Path(__file__).parent.rglob("*.py"):
        for m in _CREDENTIAL_LITERAL.finditer(path.read_text(encoding="utf-8")):
            value = m.group(1) or m.group(2)
            if not (value.isalpha() and value.islower()):
                found.add(value.encode())
    return frozenset(found)


TEST_CREDENTIALS = _test_credentials()
_scanned: dict[Path, tuple[int, int]] = {}  # SQLite files scanned, with the (size, mtime) scanned


def _fail_on(findings: list[Finding], what: str) -> None:
    if findings:
        pytest.fail(f"credentials in {what}:\n" + "\n".join(f"  {f}" for f in findings), pytrace=False)


@pytest.fixture(autouse=True)
def _no_credentials_in_test_stores(request: pytest.FixtureRequest) -> Iterator[None]:
    """The SQLite stores a test wrote under its tmp_path hold no credential (checked after it)."""
    tmp: Path | None = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None and tmp.exists():
        _fail_on(scan_tree(tmp, TEST_CREDENTIALS, _scanned), "the stores this test wrote")


@pytest.fixture(scope="session", autouse=True)
def _no_credentials_in_any_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """... and neither do those written elsewhere under pytest's temp directory (module and
    session fixtures' `mktemp` directories), checked once the session is done."""
    yield
    _fail_on(scan_tree(tmp_path_factory.getbasetemp(), TEST_CREDENTIALS, _scanned), "the session's stores")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The daemons `tests.trainer.test_daemon.make_daemon` built (then the stores `own_store`
    opened) are closed when the test's body
    ends, before its fixtures' teardown: a daemon left open renews its lease from a thread,
    against a database the `pg_url` fixture is about to drop."""
    yield
    import sys

    helpers = sys.modules.get("tests.trainer.test_daemon")
    while helpers is not None and helpers.OPEN_DAEMONS:
        helpers.OPEN_DAEMONS.pop().close()
    while helpers is not None and helpers.OPEN_STORES:
        helpers.OPEN_STORES.pop().close()


@pytest.fixture(scope="session")
def llm_server() -> Iterator[LLMTestServer]:
    with LLMTestServer() as server:
        yield server


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresTestServer | str]:
    url = os.environ.get("LIGHTNING_TEST_PG_URL")
    if url:
        yield url
        return
    server = PostgresTestServer()
    server.start()
    try:
        yield server
    finally:
        server.destroy()


def _base_pg_url(pg: PostgresTestServer | str) -> str:
    return pg if isinstance(pg, str) else pg.url


@pytest.fixture
def pg_url(pg_server: PostgresTestServer | str) -> Iterator[str]:
    """A fresh, empty database on the session's PostgreSQL server."""
    base = sa.make_url(_base_pg_url(pg_server))
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = base.set(database=name).render_as_string(hide_password=False)
    yield url
    try:
        findings = scan_database(url, TEST_CREDENTIALS)  # before the drop: what the test left there
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    _fail_on(findings, f"the PostgreSQL database {name}")


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'traces.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def store(store_url: str) -> Iterator[TraceStore]:
    s = TraceStore(store_url)
    yield s
    s.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many cases the fuzz tests tried (tests/fuzzing.py), by what they fuzzed."""
    import sys

    fuzzing = sys.modules.get("tests.fuzzing")
    cases = getattr(fuzzing, "CASES", None)
    if not cases:
        return
    terminalreporter.section("bad input: cases tried")
    for what, n in sorted(cases.items()):
        terminalreporter.write_line(f"{n:6d}  {what}")
    terminalreporter.write_line(f"{sum(cases.values()):6d}  in all")
