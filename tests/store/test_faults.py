"""The database going away mid-run: agent calls still succeed, spans wait and are written later."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from lightning_middleware import LLMCall, TraceStore, rollout, wrap
from lightning_middleware.testing import LLMTestServer, PostgresTestServer
from tests.faults.matrix import Cell, report, wait_for


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


@pytest.mark.slow
@pytest.mark.postgres
def test_postgres_restarted_under_load_loses_nothing(llm_server: LLMTestServer) -> None:
    """PostgreSQL stopped and started again while 6 wrap() agents and 4 gateway agents keep calling:
    writes fail mid-batch, the buffer grows, then everything answered is written exactly once."""
    import threading
    import uuid

    import httpx

    from lightning_middleware.gateway import Gateway

    with PostgresTestServer() as pg:
        store = TraceStore(pg.url, writer_interval_s=0.01)
        client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store)
        stop = threading.Event()
        answered: dict[str, int] = {}  # rollout id -> calls the agent was answered
        errors: list[str] = []

        def wrap_agent(k: int) -> None:
            n = 0
            while not stop.is_set():
                with rollout(f"w{k}-{n}", store=store, flush_timeout=0.05) as r:
                    for i in range(2):
                        msgs = [{"role": "user", "content": f"{k} {n} {i}"}]
                        client.chat.completions.create(model="m", messages=msgs)  # type: ignore[arg-type]
                    r.reward(1.0)
                answered[r.id] = 2
                n += 1

        unavailable: list[str] = []  # the gateway's rollout routes answer 503 while the store is down

        def post_retrying(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
            """What a client of the rollout routes does: retry a 503 (store_unavailable) after a pause.
            Creating with our own id and finishing are idempotent, so a retry never doubles them."""
            while True:
                r = http.post(path, json=body)
                if r.status_code != 503:
                    r.raise_for_status()
                    return
                assert r.json()["error"]["code"] == "store_unavailable" and r.headers["retry-after"]
                unavailable.append(path)
                time.sleep(0.2)  # Retry-After says 5 s; shortened to keep the test short

        def gateway_agent(k: int, url: str) -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                n = 0
                while not stop.is_set():
                    rid = uuid.uuid4().hex
                    post_retrying(http, "/rollouts", {"task_id": f"g{k}-{n}", "id": rid})
                    for i in range(2):  # the LLM calls themselves never wait on the store
                        body = {"model": "m", "messages": [{"role": "user", "content": f"g {k} {n} {i}"}]}
                        http.post(f"/rollouts/{rid}/v1/chat/completions", json=body).raise_for_status()
                    post_retrying(http, f"/rollouts/{rid}/finish", {"reward": 1.0})
                    answered[rid] = 2
                    n += 1

        down, opened = threading.Event(), threading.Event()

        def finisher(url: str) -> None:
            """A rollout opened before the outage and finished during it: its finish must be retried."""
            with httpx.Client(base_url=url, timeout=60) as http:
                rid = uuid.uuid4().hex
                post_retrying(http, "/rollouts", {"task_id": "finisher", "id": rid})
                body = {"model": "m", "messages": [{"role": "user", "content": "before the outage"}]}
                http.post(f"/rollouts/{rid}/v1/chat/completions", json=body).raise_for_status()
                opened.set()
                down.wait(60)
                post_retrying(http, f"/rollouts/{rid}/finish", {"reward": 1.0})
                answered[rid] = 1

        def guarded(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - an agent's failure is the finding, reported below
                errors.append(f"{type(exc).__name__}: {exc}")

        with Gateway([llm_server.base_url], store, health_interval_s=0) as gw:
            threads = [threading.Thread(target=guarded, args=(wrap_agent, k)) for k in range(6)]
            threads += [threading.Thread(target=guarded, args=(gateway_agent, k, gw.url)) for k in range(4)]
            threads.append(threading.Thread(target=guarded, args=(finisher, gw.url)))
            for t in threads:
                t.start()
            # Each phase waits for what it needs, not a guess at how long that takes on this machine.
            wait_for("the finisher's rollout open, the agents' first 20 done",
                     lambda: opened.is_set() and len(answered) >= 20)
            pg.stop()  # in the middle of the agents' writes
            down.set()
            at_stop = len(answered)

            def outage_seen() -> bool:  # writes failed, the finisher's finish refused, agents went on
                stats = store.writer_stats()
                return (stats is not None and stats.failures >= 1 and len(answered) >= at_stop + 10
                        and any(path.endswith("/finish") for path in unavailable))

            wait_for("the outage seen by the writer, the gateway and the agents", outage_seen)
            pending_down = store.writer_stats().pending
            t_start = time.monotonic()
            pg.start()
            up_s = time.monotonic() - t_start
            at_start = len(answered)
            wait_for("10 rollouts answered after the restart", lambda: len(answered) >= at_start + 10)
            stop.set()
            for t in threads:
                t.join(60)
            assert not errors, errors[:3]  # no agent call failed: the database is not on their path
            assert store.flush(60)
            recovery = time.monotonic() - t_start
        stats = store.writer_stats()
        calls = sum(answered.values())
        held = {rid: len(store.calls(rid)) for rid in answered}
        missing = {rid: n for rid, n in held.items() if n != answered[rid]}
        assert not missing, list(missing.items())[:5]
        rollouts = store.query_rollouts()
        assert len(rollouts) == len(answered) and all(r.status == "succeeded" for r in rollouts)
        assert stats.dropped == 0 and stats.failures >= 1  # the outage did happen mid-run
        # A finish refused while the store was down was retried and took (it answered 409 before).
        assert any(path.endswith("/finish") for path in unavailable), unavailable
        doubled = [r.id for r in rollouts if sum(w.final for w in store.rewards(r.id)) != 1]
        assert not doubled, doubled[:5]  # a retried finish does not store its reward twice
        report(Cell("PostgreSQL restarted under load (6 wrap + 4 gateway agents)", sent=calls,
                    recorded=sum(held.values()), lost=0, recovery_s=round(recovery, 2),
                    note=f"{len(answered)} rollouts; {pending_down} ops buffered while down, {stats.failures} failed "
                         f"writes retried; the gateway's rollout routes answered {len(unavailable)} x 503 "
                         f"store_unavailable (retried); no LLM call failed; server up in {up_s:.2f}s"))
        store.close()
