"""Fault matrix, SQLite cells: the disk full, a long reader, a long writer holding the lock.

The agent's calls must never fail or wait on the store: they go to the background writer's
bounded buffer (`max_buffer` ops, 200,000 by default), which retries a failed batch with backoff
("database or disk is full" and "database is locked" are transient errors). Nothing is lost
unless the buffer overflows (counted in `writer_stats().dropped`, logged; tests/store/test_faults.py)
or the process dies before the store is back. A rollout's end waits up to its `flush_timeout`.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.testing import LLMTestServer
from tests.faults.matrix import Cell, report

CALLS = 30


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: room for the schema and a WAL of up to 1000 16 KiB pages. Mounting needs root
    (as here); elsewhere the cell is skipped, saying why."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the full-disk cell: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> Path:
    """Write a file until the disk is full; returns it (delete it to free the disk)."""
    filler = disk / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        try:
            while f.write(chunk):
                pass
        except OSError:
            pass
    return filler


def _calls(client: openai.OpenAI, n: int, pad: int = 0) -> float:
    """n calls (each prompt `pad` characters longer); returns the slowest one's seconds (the store
    must not slow them down)."""
    slowest = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        out = client.chat.completions.create(model="m", max_tokens=8,
                                             messages=[{"role": "user", "content": "x" * pad + f" q{i}"}])
        slowest = max(slowest, time.perf_counter() - t0)
        assert out.choices[0].message.content.startswith("echo")
    return slowest


def test_sqlite_full_disk(small_disk: Path, llm_server: LLMTestServer) -> None:
    store = TraceStore(f"sqlite:///{small_disk / 'traces.db'}", writer_interval_s=0.01)
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store)
    with rollout("before", store=store) as r1:
        _calls(client, 1)
    filler = _fill(small_disk)
    # The WAL reuses the space it already has after a checkpoint, so writes go on for a while on a
    # full disk: call until one needs a page the disk cannot give (a write fails and is retried).
    sent, slowest = 0, 0.0
    with rollout("disk-full", store=store, flush_timeout=0.5) as r2:
        while not (store.writer_stats().failures and sent >= CALLS):  # type: ignore[union-attr]
            assert sent < 3000, "the disk never filled up"
            slowest = max(slowest, _calls(client, 1, pad=4096))
            sent += 1
        r2.reward(1.0)
    stats = store.writer_stats()
    assert stats is not None and stats.failures >= 1 and stats.dropped == 0 and stats.pending >= 1
    assert "full" in (stats.last_error or "")
    filler.unlink()  # space comes back
    t0 = time.monotonic()
    assert store.flush(30)
    recovery = time.monotonic() - t0
    assert len(store.calls(r1.id)) == 1 and len(store.calls(r2.id)) == sent
    assert store.get_rollout(r2.id).status == "succeeded" and store.get_rollout(r2.id).final_reward == 1.0
    report(Cell("SQLite disk full", sent=sent + 1, recorded=len(store.calls(r2.id)) + 1, lost=0,
                recovery_s=round(recovery, 2),
                note=f"{stats.pending} ops buffered, {stats.failures} failed writes retried; "
                     f"slowest call {slowest * 1000:.0f} ms"))
    store.close()


def test_sqlite_long_reader_does_not_block_the_writer(tmp_path: Path, llm_server: LLMTestServer) -> None:
    path = tmp_path / "traces.db"
    store = TraceStore(f"sqlite:///{path}", writer_interval_s=0.01)
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store)
    reader = store.engine.raw_connection()
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM llm_calls").fetchall()  # holds a read snapshot from here on
        with rollout("long-reader", store=store) as r:
            slowest = _calls(client, CALLS)
        # WAL: a reader never blocks the writer, which committed everything while the read went on.
        assert len(store.calls(r.id)) == CALLS
        wal = Path(f"{path}-wal").stat().st_size
    finally:
        reader.rollback()
        reader.close()
    report(Cell("SQLite long reader", sent=CALLS, recorded=CALLS, lost=0, recovery_s=0.0,
                note=f"WAL mode: written during the read (WAL {wal // 1024} KiB); "
                     f"slowest call {slowest * 1000:.0f} ms"))
    store.close()


def test_sqlite_locked_by_a_long_writer(tmp_path: Path, llm_server: LLMTestServer) -> None:
    """Another process holds the write lock longer than the busy timeout: batches wait and are retried."""
    path = tmp_path / "traces.db"
    store = TraceStore(f"sqlite:///{path}", writer_interval_s=0.01)
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store)
    import sqlite3

    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    release_at = time.monotonic() + 3.0
    try:
        with rollout("locked", store=store, flush_timeout=0.2) as r:
            slowest = _calls(client, CALLS)
        locked_pending = store.writer_stats().pending  # type: ignore[union-attr]
        # released once the calls are made and counted (a 3 s timer could run out first on a loaded
        # machine and let the writer flush some), and not before 3 s: past the busy timeout
        time.sleep(max(0.0, release_at - time.monotonic()))
        release_at = time.monotonic()
    finally:
        locker.rollback()
        locker.close()
    assert locked_pending >= CALLS
    assert store.flush(30)
    recovery = max(0.0, time.monotonic() - release_at)
    assert len(store.calls(r.id)) == CALLS and store.get_rollout(r.id).status == "succeeded"
    assert store.writer_stats().dropped == 0  # type: ignore[union-attr]
    report(Cell("SQLite locked by another writer (3 s)", sent=CALLS, recorded=CALLS, lost=0,
                recovery_s=round(recovery, 2),
                note=f"{locked_pending} ops buffered while locked; slowest call {slowest * 1000:.0f} ms"))
    store.close()


