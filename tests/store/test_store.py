"""The trace store on SQLite and PostgreSQL: schema, compact token storage, reads, claims, faults."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from lightning_middleware import LLMCall, PolicyVersion, Reward, Rollout, StoreError, TraceStore, TrainStep
from lightning_middleware.records import Choice
from lightning_middleware.store import schema as S


def _call(rollout_id: str | None, index: int, **kw) -> LLMCall:
    base = dict(
        id=uuid.uuid4().hex, rollout_id=rollout_id, call_index=index,
        request={"messages": [{"role": "user", "content": "x"}]},
        response={"choices": [{"message": {"content": "y"}}]}, prompt_token_ids=(1, 2, 3),
        completion_token_ids=(4, 5), logprobs=(-0.5, -1.25), status_code=200, is_training=True, started_at=time.time(),
    )
    base.update(kw)
    return LLMCall(**base)


def test_roundtrip_exact_tokens_and_logprobs(store: TraceStore) -> None:
    store.create_rollout(Rollout(id="r1", task_id="t1", input={"q": 1}, metadata={"k": "v"}))
    big = tuple(range(151_640, 151_650)) + (0, 2**31 - 1)
    lps = (-0.0, -1e-7, -3.5, -17.25)
    store.record_call(_call("r1", 0, prompt_token_ids=big, completion_token_ids=(7, 8, 9, 10), logprobs=lps))
    [got] = store.calls("r1")
    assert got.prompt_token_ids == big
    assert got.completion_token_ids == (7, 8, 9, 10)
    assert got.logprobs is not None and max(abs(a - b) for a, b in zip(got.logprobs, lps)) < 1e-6
    assert got.request["messages"][0]["content"] == "x"
    r = store.get_rollout("r1")
    assert r is not None and r.input == {"q": 1} and r.metadata == {"k": "v"} and r.status == "running"


def test_token_ids_are_stored_as_packed_binary(store: TraceStore) -> None:
    store.record_call(_call(None, 0, prompt_token_ids=tuple(range(100)), completion_token_ids=(1,), logprobs=(-1.0,)))
    with store.engine.connect() as conn:
        row = conn.execute(sa.select(S.llm_calls.c.prompt_token_ids, S.llm_calls.c.logprobs)).one()
    assert isinstance(row.prompt_token_ids, bytes) and len(row.prompt_token_ids) == 4 * 100
    assert isinstance(row.logprobs, bytes) and len(row.logprobs) == 4


def test_flags_and_blobs_round_trip_through_the_bulk_insert(store: TraceStore) -> None:
    """The bulk insert hands the driver 0/1 and bytearrays (sqlite3's unadapted types): what is
    read back is the booleans and the exact values, and SQLite stores integers and blobs."""
    flags = [(s, p, t) for s in (False, True) for p in (False, True) for t in (False, True)]
    for i, (stream, partial, training) in enumerate(flags):
        store.submit_call(_call("rf", i, stream=stream, partial=partial, is_training=training))
    assert store.flush()
    got = store.calls("rf")
    assert [(c.stream, c.partial, c.is_training) for c in got] == flags
    assert all(c.prompt_token_ids == (1, 2, 3) and c.completion_token_ids == (4, 5) for c in got)
    if store.dialect == "sqlite":
        with store.engine.connect() as conn:
            kinds = set(conn.exec_driver_sql("SELECT typeof(stream), typeof(is_training), typeof(prompt_token_ids), "
                                             "typeof(logprobs) FROM llm_calls WHERE rollout_id = 'rf'").all())
        assert kinds == {("integer", "integer", "blob", "blob")}


def test_missing_logprobs_stay_none_and_empty_ids_stay_empty(store: TraceStore) -> None:
    store.record_call(_call("r", 0, prompt_token_ids=(), completion_token_ids=(), logprobs=None, is_training=False))
    [got] = store.calls("r")
    assert got.prompt_token_ids == () and got.completion_token_ids == () and got.logprobs is None
    assert not got.has_token_ids


def test_extra_choices_round_trip_inside_the_response_json(store: TraceStore) -> None:
    """The choices after the first of an n > 1 call come back exactly, each with its own tokens and
    logprobs (float32, as choice 0's), from inside the response column; choice 0 stays in the columns."""
    extra = (Choice(1, (9, 2**31 - 1, 0), (-0.25, -0.125, -3.5), "length"), Choice(2, (), None, "stop"),
             Choice(3, (151_643,), (-17.25,), None))
    resp = {"choices": [{"index": k, "message": {"content": f"y{k}"}} for k in range(4)]}
    store.record_call(_call("r", 0, response=resp, extra_choices=extra))
    store.record_call(_call("r", 1, response=None, extra_choices=extra[:1]))  # a hand-made record without one
    got, bare = store.calls("r")
    assert got.extra_choices == extra  # these logprobs are exact in float32
    assert got.response == resp and got.completion_token_ids == (4, 5) and got.logprobs == (-0.5, -1.25)
    assert [c.index for c in got.choices] == [0, 1, 2, 3] and got.choice(1).completion_token_ids == (9, 2**31 - 1, 0)
    assert bare.response is None and bare.extra_choices == extra[:1]
    with store.engine.connect() as conn:
        stored = conn.execute(sa.select(S.llm_calls.c.response).where(S.llm_calls.c.call_index == 0)).scalar_one()
    assert stored["lightning_extra_choices"][0]["index"] == 1 and isinstance(
        stored["lightning_extra_choices"][0]["token_ids"], str)  # packed as the columns are, base64


def test_a_call_with_one_choice_stores_its_response_as_before(store: TraceStore) -> None:
    resp = {"choices": [{"index": 0, "message": {"content": "y"}}]}
    store.record_call(_call("r", 0, response=resp))
    with store.engine.connect() as conn:
        stored = conn.execute(sa.select(S.llm_calls.c.response)).scalar_one()
    assert stored == resp and store.calls("r")[0].extra_choices == ()


def test_unreadable_extra_choices_leave_the_call_readable(store: TraceStore, caplog) -> None:
    store.record_call(_call("r", 0, response={"choices": [], "lightning_extra_choices": [{"index": 1,
                                                                                          "token_ids": "%%"}]}))
    [got] = store.calls("r")
    assert got.extra_choices == () and got.response == {"choices": []} and got.completion_token_ids == (4, 5)
    assert "unreadable" in caplog.text


def test_query_filters(store: TraceStore) -> None:
    t0 = time.time()
    specs = [("a", "g1", "train", "succeeded", t0), ("b", "g1", "train", "failed", t0 + 1),
             ("c", "g2", "val", "succeeded", t0 + 2), ("d", "g2", "train", "running", t0 + 3)]
    for rid, task, mode, status, ts in specs:
        store.create_rollout(Rollout(id=rid, task_id=task, mode=mode, status=status, created_at=ts))
    ids = lambda rs: [r.id for r in rs]  # noqa: E731
    assert ids(store.query_rollouts()) == ["a", "b", "c", "d"]
    assert ids(store.query_rollouts(status="succeeded")) == ["a", "c"]
    assert ids(store.query_rollouts(status=["failed", "running"])) == ["b", "d"]
    assert ids(store.query_rollouts(mode="val")) == ["c"]
    assert ids(store.query_rollouts(task_id="g1")) == ["a", "b"]
    assert ids(store.query_rollouts(since=t0 + 1, until=t0 + 3)) == ["b", "c"]
    assert ids(store.query_rollouts(newest_first=True, limit=2)) == ["d", "c"]
    groups = store.rollout_groups(status="succeeded", mode="train")
    assert {k: ids(v) for k, v in groups.items()} == {"g1": ["a"]}


def test_calls_in_order_with_attempts(store: TraceStore) -> None:
    store.create_rollout(Rollout(id="r", task_id="t"))
    for idx, attempt, training in [(2, 1, True), (0, 1, False), (0, 2, True), (1, 1, True)]:
        store.record_call(_call("r", idx, attempt=attempt, is_training=training))
    assert [(c.call_index, c.attempt) for c in store.calls("r")] == [(0, 1), (0, 2), (1, 1), (2, 1)]
    assert [(c.call_index, c.attempt) for c in store.calls("r", training_only=True)] == [(0, 2), (1, 1), (2, 1)]
    store.record_call(_call(None, 0))
    assert len(store.calls(None)) == 1
    both = store.calls_for(["r", "nope"])
    assert len(both["r"]) == 4 and both["nope"] == []


def test_background_writer_orders_inserts_before_updates(store: TraceStore) -> None:
    store.submit_rollout(Rollout(id="w", task_id="t", created_at=time.time()))
    store.submit_call(_call("w", 0))
    store.submit_reward(Reward(rollout_id="w", value=0.25, name="partial", final=False))
    store.submit_reward(Reward(rollout_id="w", value=1.0))
    store.submit_rollout_end("w", status="succeeded", ended_at=time.time(), duration_s=0.5, error=None)
    assert store.flush(10)
    r = store.get_rollout("w")
    assert r is not None and r.status == "succeeded" and r.final_reward == 1.0 and r.duration_s == 0.5
    assert [(x.name, x.value, x.final) for x in store.rewards("w")] == [("partial", 0.25, False), (None, 1.0, True)]
    st = store.writer_stats()
    assert st is not None and st.written == 5 and st.dropped == 0 and st.pending == 0


def test_a_bad_op_is_rejected_alone(store: TraceStore) -> None:
    store.submit_call(_call("r", 0, id="same"))
    store.submit_call(_call("r", 1, id="same"))  # duplicate primary key: rejected, counted
    store.submit_call(_call("r", 2))
    assert store.flush(10)
    assert sorted(c.call_index for c in store.calls("r")) == [0, 2]
    st = store.writer_stats()
    assert st is not None and st.rejected == 1


def test_claims_are_exclusive_and_step_commit_consumes(store: TraceStore) -> None:
    ids = [f"r{i}" for i in range(40)]
    for rid in ids:
        store.create_rollout(Rollout(id=rid, task_id="t", status="succeeded"))
    got: dict[str, list[str]] = {}

    def claim(name: str) -> None:
        other = TraceStore(store.url.render_as_string(hide_password=False))
        got[name] = other.claim_rollouts(ids, name)
        other.close()

    threads = [threading.Thread(target=claim, args=(f"trainer{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = got["trainer0"], got["trainer1"]
    assert not set(a) & set(b) and sorted(a + b) == sorted(ids)
    store.commit_train_step(TrainStep(step=1, policy_version=1, rollout_ids=tuple(a), trainer_id="trainer0",
                                      metrics={"loss": 0.5}))
    assert {r.id for r in store.query_rollouts(consumed=True)} == set(a)
    assert store.release_claims("trainer1") == len(b)
    assert {r.id for r in store.query_rollouts(consumed=False, claimed=False)} == set(b)
    [step] = store.train_steps()
    assert step.metrics == {"loss": 0.5} and set(step.rollout_ids) == set(a)


def test_policy_versions(store: TraceStore) -> None:
    assert store.latest_policy_version() is None
    store.add_policy_version(PolicyVersion(version=0, path="/ckpt/0"))
    store.add_policy_version(PolicyVersion(version=1, path="/ckpt/1", checksum="abc", metadata={"step": 3}))
    assert store.latest_policy_version() == 1
    assert [(p.version, p.checksum, p.metadata) for p in store.policy_versions()] == [
        (0, None, {}), (1, "abc", {"step": 3})]
    store.add_policy_version(PolicyVersion(version=1, path="/other/1", trainer_id="other"))
    assert store.latest_policy_version("other") == 1 and store.get_policy_version(1, "other").path == "/other/1"
    assert [p.version for p in store.policy_versions("other")] == [1]


def test_create_rollout_is_idempotent(store: TraceStore) -> None:
    first, created = store.create_rollout(Rollout(id="same", task_id="t", input="a"))
    again, created2 = store.create_rollout(Rollout(id="same", task_id="other", input="b"))
    assert created and not created2 and again.task_id == "t" and again.input == "a"
    done = store.finish_rollout("same", status="failed", error="boom")
    assert done.status == "failed" and done.error == "boom" and done.duration_s is not None
    with pytest.raises(KeyError):
        store.finish_rollout("missing")


def test_readers_work_while_the_writer_writes(store_url: str) -> None:
    writer_store = TraceStore(store_url, writer_interval_s=0.005)
    reader_store = TraceStore(store_url)
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def read() -> None:
        # A reader polling as the trainer does (count, then a page of records), not a busy loop:
        # decoding the whole growing table back to back would starve the writer of the GIL.
        try:
            while not stop.is_set():
                seen.append(reader_store.count("llm_calls"))
                reader_store.calls_for(["live"])
                time.sleep(0.01)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def next_read() -> None:
        # Each round of writes waits for the reader's next read, so reads interleave with the writes on
        # any machine: on a loaded 2-core AVX2 EPYC a fixed 10 ms pause let the reader in 3 times in all.
        done, end = len(seen), time.monotonic() + 60
        while len(seen) == done and not errors and t.is_alive() and time.monotonic() < end:
            time.sleep(0.002)

    t = threading.Thread(target=read)
    t.start()
    for i in range(2000):
        if i % 200 == 0:
            next_read()
        writer_store.submit_call(_call("live", i))
    assert writer_store.flush(120)
    stop.set()
    t.join()
    assert not errors
    assert len(seen) >= 10 and seen == sorted(seen)  # reads saw a growing, consistent table
    assert len(reader_store.calls("live")) == 2000
    writer_store.close()
    reader_store.close()


def test_bad_urls_fail_clearly_at_open(tmp_path) -> None:
    with pytest.raises(StoreError, match="not a store URL"):
        TraceStore("::nonsense::")
    with pytest.raises(StoreError, match="unsupported store engine"):
        TraceStore("mysql://localhost/db")
    with pytest.raises(StoreError, match="does not exist"):
        TraceStore(f"sqlite:///{tmp_path}/no/such/dir/t.db")
    with pytest.raises(StoreError, match="cannot open trace store"):
        TraceStore("postgresql+psycopg://nobody:secret@127.0.0.1:1/db")
    try:
        TraceStore("postgresql+psycopg://nobody:secret@127.0.0.1:1/db")
    except StoreError as exc:
        assert "secret" not in str(exc)  # passwords never reach logs


def test_default_url_from_env(tmp_path, monkeypatch) -> None:
    from lightning_middleware.store import get_store

    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("LIGHTNING_STORE_URL", url)
    s = get_store()
    assert s.url.database == str(tmp_path / "env.db")
    assert get_store() is s and get_store(url) is s


def test_sqlite_is_in_wal_mode(tmp_path) -> None:
    s = TraceStore(f"sqlite:///{tmp_path / 'w.db'}")
    with s.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def _toast_bytes(store: TraceStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.exec_driver_sql(
            "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = 'llm_calls'::regclass").scalar())


def _toast_target(store: TraceStore) -> str | None:
    with store.engine.connect() as conn:
        options = conn.exec_driver_sql("SELECT reloptions FROM pg_class WHERE oid = 'llm_calls'::regclass").scalar()
    return dict(o.split("=", 1) for o in options or []).get("toast_tuple_target")


@pytest.mark.postgres
def test_postgres_keeps_a_span_row_inline_and_toasts_only_long_ones(pg_url: str) -> None:
    """A span of a few KB stays in the table's row, uncompressed (the TOAST step cost half of the
    server's ingestion CPU); a row past a page's worth is still TOASTed; both read back exactly."""
    store = TraceStore(pg_url)
    try:
        assert _toast_target(store) == str(S.PG_STORAGE["llm_calls"]["toast_tuple_target"])
        prompt = tuple(range(100_000, 100_700))  # 2.8 KB packed: past the default TOAST threshold
        text = "Solve the task and report the answer. " * 30
        store.record_call(_call("r1", 0, prompt_token_ids=prompt, request={"messages": [{"role": "user",
                                                                                          "content": text}]}))
        assert _toast_bytes(store) == 0
        long_prompt = tuple(range(3000))  # 12 KB: more than a row may hold inline
        store.record_call(_call("r1", 1, prompt_token_ids=long_prompt))
        assert _toast_bytes(store) > 0
        first, second = store.calls("r1")
        assert first.prompt_token_ids == prompt and first.request["messages"][0]["content"] == text
        assert second.prompt_token_ids == long_prompt
    finally:
        store.close()


@pytest.mark.postgres
def test_postgres_storage_parameters_are_restored_at_open_and_optional(pg_url: str, caplog) -> None:
    store = TraceStore(pg_url)
    with store.engine.begin() as conn:  # a store made before the parameter existed
        conn.exec_driver_sql("ALTER TABLE llm_calls RESET (toast_tuple_target)")
        conn.exec_driver_sql("CREATE ROLE lm_writer_only LOGIN")
        conn.exec_driver_sql("GRANT ALL ON ALL TABLES IN SCHEMA public TO lm_writer_only")
        conn.exec_driver_sql("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO lm_writer_only")
    assert _toast_target(store) is None
    # A user who may write but not ALTER the table: a warning, and a store that works.
    limited = TraceStore(sa.make_url(pg_url).set(username="lm_writer_only").render_as_string(hide_password=False))
    try:
        assert "could not set toast_tuple_target" in caplog.text
        limited.record_call(_call("r2", 0))
        assert [c.call_index for c in limited.calls("r2")] == [0]
        assert _toast_target(limited) is None
    finally:
        limited.close()
        with store.engine.begin() as conn:
            conn.exec_driver_sql("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM lm_writer_only")
            conn.exec_driver_sql("REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM lm_writer_only")
            conn.exec_driver_sql("DROP ROLE lm_writer_only")
    store.close()
    reopened = TraceStore(pg_url)  # its owner opens it again: the parameter is back
    try:
        assert _toast_target(reopened) == "8160"
    finally:
        reopened.close()


def test_a_submitted_op_reaches_disk_without_a_flush(store_url: str) -> None:
    """The writer's promise: an op is on disk about `interval_s` after it was submitted, even if
    nobody calls flush() (a process killed later loses only the last interval)."""
    writer_store = TraceStore(store_url, writer_interval_s=0.02)
    reader_store = TraceStore(store_url)
    try:
        for round_ in range(3):  # the first op after an idle writer, every time
            writer_store.submit_call(_call("unflushed", round_))
            deadline = time.monotonic() + 30
            # on disk (another connection sees it), and the writer has marked it written
            while reader_store.count("llm_calls") < round_ + 1 or writer_store.writer_stats().pending:
                assert time.monotonic() < deadline, f"op {round_} not written within 30 s without a flush"
                time.sleep(0.01)
    finally:
        writer_store.close()
        reader_store.close()


@pytest.mark.parametrize("argv", [
    ["inspect"], ["rollouts", "metrics"], ["rollouts", "reap"], ["export", "--out", "x.jsonl"],
])
def test_reading_commands_never_create_a_store(tmp_path, argv, capsys) -> None:
    """A mistyped SQLite path for a command that reads must fail, not leave an empty database."""
    from lightning_middleware.cli import main
    from lightning_middleware.store import open_store

    typo = tmp_path / "tarces.db"
    assert main([*argv, "--store", f"sqlite:///{typo}"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not typo.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(StoreError, match="does not exist"):
        open_store(f"sqlite:///{typo}")
    assert not typo.exists()
