"""The database going away mid-run: agent calls still succeed, spans wait and are written later."""

from __future__ import annotations

import time

import openai
import pytest

from lightning_middleware import LLMCall, TraceStore, rollout, wrap
from lightning_middleware.testing import LLMTestServer, PostgresTestServer
from tests.faults.matrix import Cell, report


@pytest.mark.slow
@pytest.mark.postgres
def test_postgres_restart_mid_run_loses_nothing(llm_server: LLMTestServer) -> None:
    with PostgresTestServer() as pg:
        store = TraceStore(pg.url, writer_interval_s=0.01)
        client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store)
        with rollout("before", store=store) as r1:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
        pg.stop()  # the database goes away
        t0 = time.monotonic()
        with rollout("during", store=store, flush_timeout=0.5) as r2:
            for i in range(5):
                out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
                assert out.choices[0].message.content == f"echo: q{i}"
            r2.reward(1.0)
        assert time.monotonic() - t0 < 10  # calls never waited on the dead database
        stats = store.writer_stats()
        assert stats.pending >= 7 and stats.failures >= 1 and stats.dropped == 0
        t_start = time.monotonic()
        pg.start()  # it comes back
        up_s = time.monotonic() - t_start
        assert store.flush(30)
        recovery = time.monotonic() - t_start
        assert len(store.calls(r1.id)) == 1
        assert len(store.calls(r2.id)) == 5
        ro = store.get_rollout(r2.id)
        assert ro.status == "succeeded" and ro.final_reward == 1.0
        report(Cell("PostgreSQL stopped and restarted mid-run", sent=6, recorded=6, lost=0,
                    recovery_s=round(recovery, 2),
                    note=f"{stats.pending} ops buffered, {stats.failures} failed writes retried; "
                         f"server up in {up_s:.2f}s, buffer written {recovery - up_s:.2f}s later"))
        store.close()


def test_full_buffer_drops_are_counted_not_silent(tmp_path, caplog) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'x.db'}", max_buffer=3)
    # Hold the writer back by keeping the database locked from another connection.
    blocker = store.engine.raw_connection()
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        accepted = [store.writer.submit("call", LLMCall(id=str(i), rollout_id="r", call_index=i, started_at=1.0))
                    for i in range(10)]
    finally:
        blocker.rollback()
        blocker.close()
    assert accepted.count(False) >= 7
    assert store.writer_stats().dropped == accepted.count(False)
    assert any("dropped" in m for m in caplog.messages)
    store.close(timeout=1)
