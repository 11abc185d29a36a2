"""A retried LLM call with an `Idempotency-Key` is sampled and trained once, whichever gateway it
reaches (issue 33): the key is kept with the call's record, so a gateway restarted since the
first attempt, or another replica on the same store, answers the retry from the record instead
of sending it to the engine again. Real uvicorn gateways, the real test LLM server, SQLite and
PostgreSQL; whole bodies, streams, and a Responses API call translated to chat."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest
import sqlalchemy as sa

from lightning_middleware import TraceStore
from lightning_middleware.gateway import REPLAY_HEADER, Gateway
from lightning_middleware.store import schema as S
from lightning_middleware.testing import LLMTestServer

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def _gateway(llm_server: LLMTestServer, store: TraceStore) -> Gateway:
    return Gateway([llm_server.base_url], store, health_interval_s=0)


def _open(gw: Gateway) -> str:
    rid = "ck-" + uuid.uuid4().hex[:10]
    httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t"}, timeout=30).raise_for_status()
    return rid


def _chat(gw: Gateway, rid: str, body: dict, key: str, **headers: str) -> httpx.Response:
    return httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json=body,
                      headers={"idempotency-key": key, **headers}, timeout=30)


def _recorded(store: TraceStore, rid: str, n: int) -> None:
    """Wait until the store holds `n` calls of `rid` (a stream's record is handed to the writer
    once its last chunk went out, which can be just after the client read it)."""
    deadline = time.monotonic() + 30
    while len(store.calls(rid)) < n:
        assert time.monotonic() < deadline, f"the store never held {n} calls of {rid}"
        store.flush()
        time.sleep(0.01)


def _events(sse: bytes) -> list[dict]:
    lines = [line[6:] for line in sse.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
def test_a_restarted_gateway_answers_a_retry_from_the_record(llm_server: LLMTestServer, store: TraceStore,
                                                             tools: bool) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "restart me"}], "temperature": 1.0}
    if tools:
        body["tools"] = TOOLS
    with _gateway(llm_server, store) as gw:
        rid = _open(gw)
        first = _chat(gw, rid, body, "call-1")
    store.flush()
    with _gateway(llm_server, store) as gw2:  # nothing in its memory
        retry = _chat(gw2, rid, body, "call-1")
        changed = _chat(gw2, rid, {**body, "temperature": 0.5}, "call-1")
        other_rollout = _chat(gw2, _open(gw2), body, "call-1")  # keys are per rollout
    assert first.status_code == retry.status_code == 200
    assert REPLAY_HEADER not in first.headers and retry.headers[REPLAY_HEADER] == "1"
    a, b = first.json(), retry.json()
    assert b["choices"][0]["message"] == a["choices"][0]["message"]
    assert (tools and a["choices"][0]["message"]["tool_calls"]) or not tools
    def fields(r: dict) -> tuple:
        choice = r["choices"][0]
        return r["id"], r["usage"], r["prompt_token_ids"], choice["token_ids"], choice["finish_reason"]

    assert fields(b) == fields(a)
    assert changed.status_code == 409 and changed.json()["error"]["code"] == "idempotency_conflict"
    assert other_rollout.status_code == 200 and REPLAY_HEADER not in other_rollout.headers
    store.flush()
    [call] = store.calls(rid)  # the retry recorded nothing: one training call
    assert call.idempotency_key == "call-1" and call.is_training


def test_another_replica_on_the_same_store_answers_a_streamed_retry(llm_server: LLMTestServer,
                                                                    store: TraceStore) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "stream me"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with _gateway(llm_server, store) as gw1, _gateway(llm_server, store) as gw2:
        rid = _open(gw1)
        first = _chat(gw1, rid, body, "s-1")
        _recorded(store, rid, 1)
        retry = _chat(gw2, rid, body, "s-1")
        # Through the openai SDK's own stream parser, as an agent would read it (the SDK writes
        # the body its own way: a key of its own, sent first to the other replica).
        sdk = [openai.OpenAI(base_url=g.rollout_base_url(rid), api_key="sk-test") for g in (gw1, gw2)]
        for client in sdk:
            chunks = list(client.chat.completions.create(model="m", messages=body["messages"], stream=True,
                                                         stream_options={"include_usage": True},
                                                         extra_headers={"Idempotency-Key": "s-2"}))
            _recorded(store, rid, 2)
    assert retry.headers[REPLAY_HEADER] == "1" and retry.headers["content-type"].startswith("text/event-stream")
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in _events(first.content) if e["choices"])
    assert text.startswith("echo: stream me")
    replayed = _events(retry.content)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in replayed if e["choices"]) == text
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = [e["usage"] for e in _events(first.content) if e.get("usage")]
    assert [e["usage"] for e in replayed if e.get("usage")] == usage and chunks[-1].usage is not None
    store.flush()
    calls = store.calls(rid)
    assert [(c.stream, c.is_training, c.idempotency_key) for c in calls] == [(True, True, "s-1"), (True, True, "s-2")]


def test_a_translated_call_is_answered_from_the_record_in_the_callers_format(llm_server: LLMTestServer,
                                                                            store: TraceStore) -> None:
    with _gateway(llm_server, store) as gw:
        rid = _open(gw)
        client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="sk-test")
        first = client.responses.create(model="m", input="translate me", extra_headers={"Idempotency-Key": "r-1"})
    store.flush()
    with _gateway(llm_server, store) as gw2:
        client = openai.OpenAI(base_url=gw2.rollout_base_url(rid), api_key="sk-test")
        raw = client.responses.with_raw_response.create(model="m", input="translate me",
                                                        extra_headers={"Idempotency-Key": "r-1"})
        stream_first = list(client.responses.create(model="m", input="stream", stream=True,
                                                    extra_headers={"Idempotency-Key": "r-2"}))
        _recorded(store, rid, 2)
    with _gateway(llm_server, store) as gw3:
        client = openai.OpenAI(base_url=gw3.rollout_base_url(rid), api_key="sk-test")
        stream_retry = list(client.responses.create(model="m", input="stream", stream=True,
                                                    extra_headers={"Idempotency-Key": "r-2"}))
    retry = raw.parse()
    assert raw.headers[REPLAY_HEADER] == "1"
    assert retry.output_text == first.output_text and retry.id == first.id and first.output_text
    done_first = [e for e in stream_first if e.type == "response.completed"]
    done_retry = [e for e in stream_retry if e.type == "response.completed"]
    assert len(done_first) == len(done_retry) == 1
    assert done_retry[0].response.output_text == done_first[0].response.output_text != ""
    store.flush()
    assert len(store.calls(rid)) == 2  # r-1 and r-2, one record each


def test_a_failed_first_attempt_is_not_replayed(llm_server: LLMTestServer, store: TraceStore) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "fail once " + uuid.uuid4().hex}]}
    with _gateway(llm_server, store) as gw:
        rid = _open(gw)
        failed = _chat(gw, rid, body, "f-1", **{"x-test-fail-times": "1"})
    store.flush()
    with _gateway(llm_server, store) as gw2:
        retry = _chat(gw2, rid, body, "f-1", **{"x-test-fail-times": "1"})
    assert failed.status_code == 502 and retry.status_code == 200 and REPLAY_HEADER not in retry.headers
    store.flush()
    calls = store.calls(rid)
    assert [(c.status_code, c.is_training) for c in calls] == [(500, False), (200, True)]


def test_a_bad_key_is_a_400_and_records_nothing(llm_server: LLMTestServer, store: TraceStore) -> None:
    with _gateway(llm_server, store) as gw:
        rid = _open(gw)
        long = _chat(gw, rid, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "k" * 256)
    assert long.status_code == 400
    assert long.json()["error"]["code"] == "bad_idempotency_key"
    store.flush()
    assert store.calls(rid) == []


def test_a_version_2_store_gains_the_key_column_and_its_index(store_url: str) -> None:
    """A store made before version 3: `llm_calls` without `idempotency_key`; opening it adds the
    column and the index, keeps its rows, and the lookup works on it."""
    old = sa.MetaData()
    for table in S.metadata.tables.values():
        if table.name != "llm_calls":
            table.to_metadata(old)
    sa.Table("llm_calls", old, *[sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable,
                                           server_default=c.server_default)
                                 for c in S.llm_calls.columns if c.name != "idempotency_key"],
             sa.Index("ix_llm_calls_rollout_v2", "rollout_id", "call_index"))
    engine = sa.create_engine(store_url)
    old.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(old.tables["schema_info"]).values(key="version", value="2"))
        conn.execute(sa.insert(old.tables["llm_calls"]).values(id="c-old", rollout_id="r", call_index=0,
                                                               endpoint="chat.completions", started_at=1.0))
    engine.dispose()
    store = TraceStore(store_url)
    try:
        inspector = sa.inspect(store.engine)
        assert "idempotency_key" in {c["name"] for c in inspector.get_columns("llm_calls")}
        assert "ix_llm_calls_idempotency" in {i["name"] for i in inspector.get_indexes("llm_calls")}
        with store.engine.connect() as conn:
            assert conn.execute(sa.select(S.schema_info.c.value)).scalar() == str(S.SCHEMA_VERSION) == "3"
        [old_call] = store.calls("r")
        assert old_call.id == "c-old" and old_call.idempotency_key is None
        assert store.keyed_call("r", "anything") is None
    finally:
        store.close()
