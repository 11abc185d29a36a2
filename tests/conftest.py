"""Shared fixtures: one test LLM server and one PostgreSQL server per session.

Every store-touching test runs on SQLite and on a real PostgreSQL server. The
server is started here from the Debian `postgresql` package (or taken from
LIGHTNING_TEST_PG_URL); if neither is available the PostgreSQL cases fail
with a message saying what to install, they are not skipped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from lightning_middleware import TraceStore
from lightning_middleware.testing import LLMTestServer, PostgresTestServer

pytest_plugins = ["tests.fixtures_vllm"]  # one real vLLM CPU server per session, for the tests that ask


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
    yield base.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


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
