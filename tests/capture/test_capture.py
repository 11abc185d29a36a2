"""wrap() on real openai clients against a real (deterministic) HTTP server, on both store engines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import uuid

import httpx
import httpx2
import openai
import pytest

from lightning_middleware import TraceStore, emit_reward, propagate, rollout, rollout_headers, wrap
from lightning_middleware.testing import TEST_BASE_URL, LLMTestServer, llm_http_client, render_chat, tokenize

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "math",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]


def _client(store: TraceStore, **kw) -> openai.OpenAI:
    """A wrapped openai client talking to the test LLM in-process (openai 3.x sends through httpx2)."""
    return wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="sk-test", http_client=llm_http_client(httpx2), **kw),
                store=store)


def _aclient(store: TraceStore, **kw) -> openai.AsyncOpenAI:
    return wrap(openai.AsyncOpenAI(base_url=TEST_BASE_URL, api_key="sk-test",
                                   http_client=llm_http_client(httpx2, asynchronous=True), **kw), store=store)


def test_sync_chat_records_exact_tokens(store: TraceStore) -> None:
    client = _client(store)
    with rollout("task-1", store=store, input={"q": "2+2"}) as r:
        out = client.chat.completions.create(model="m", messages=MSGS, temperature=0.7, max_tokens=50)
        r.reward(1.0)
    assert out.choices[0].message.content == "echo: what is 2+2?"
    [call] = store.calls(r.id)
    assert call.prompt_token_ids == tuple(tokenize(render_chat(MSGS)))
    assert call.completion_token_ids == tuple(tokenize("echo: what is 2+2?"))
    assert call.logprobs is not None and len(call.logprobs) == len(call.completion_token_ids)
    assert call.logprobs[:3] == pytest.approx((0.0, -0.1, -0.2), abs=1e-6)
    assert call.is_training and not call.partial and call.status_code == 200 and call.attempt == 1
    assert call.request["messages"] == MSGS and call.request["temperature"] == 0.7 and call.request["max_tokens"] == 50
    assert "return_token_ids" not in call.request  # the caller's request as written
    assert call.response["choices"][0]["message"]["content"] == "echo: what is 2+2?"
    assert "token_ids" not in call.response["choices"][0]  # arrays live in their own columns
    assert call.model == "m" and call.endpoint == "chat.completions" and call.latency_s > 0
    ro = store.get_rollout(r.id)
    assert ro is not None and ro.status == "succeeded" and ro.final_reward == 1.0 and ro.duration_s > 0
    assert ro.input == {"q": "2+2"}


async def test_async_chat_and_gather_keeps_call_order(store: TraceStore) -> None:
    client = _aclient(store)
    async with rollout("task-2", store=store) as r:
        outs = await asyncio.gather(*[
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
            for i in range(8)
        ])
        emit_reward(0.5)
    calls = store.calls(r.id)
    assert sorted(c.call_index for c in calls) == list(range(8))
    recorded = {c.response["choices"][0]["message"]["content"] for c in calls}
    assert recorded == {o.choices[0].message.content for o in outs}
    assert all(c.is_training for c in calls)
    assert store.get_rollout(r.id).final_reward == 0.5


def _stream_and_plain(client: openai.OpenAI, store: TraceStore, **kw):
    with rollout("s", store=store) as r:
        plain = client.chat.completions.create(model="m", messages=MSGS, **kw)
        stream = client.chat.completions.create(model="m", messages=MSGS, stream=True,
                                                stream_options={"include_usage": True}, **kw)
        pieces = [ch for ch in stream]
    return r, plain, pieces


def test_stream_reassembles_text_tokens_and_logprobs(store: TraceStore) -> None:
    r, plain, pieces = _stream_and_plain(_client(store), store)
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert text == plain.choices[0].message.content
    nonstream, streamed = store.calls(r.id)
    assert streamed.stream and not nonstream.stream
    assert streamed.prompt_token_ids == nonstream.prompt_token_ids
    assert streamed.completion_token_ids == nonstream.completion_token_ids
    assert streamed.logprobs == nonstream.logprobs
    assert streamed.finish_reason == "stop" and streamed.is_training and not streamed.partial
    assert streamed.response["choices"][0]["message"]["content"] == text
    assert streamed.response["usage"]["completion_tokens"] == len(streamed.completion_token_ids)


def test_stream_tool_calls_reassembled(store: TraceStore) -> None:
    client = _client(store)
    with rollout("tools", store=store) as r:
        plain = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
        streamed = list(client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=True))
    assert streamed and plain.choices[0].message.tool_calls[0].function.name == "calc"
    a, b = store.calls(r.id)
    tc_plain = a.response["choices"][0]["message"]["tool_calls"][0]
    tc_stream = b.response["choices"][0]["message"]["tool_calls"][0]
    assert tc_stream["function"] == tc_plain["function"] and tc_stream["id"] == tc_plain["id"]
    assert json.loads(tc_stream["function"]["arguments"]) == {"query": "what is 2+2?"}
    assert b.finish_reason == "tool_calls" and b.completion_token_ids == a.completion_token_ids
    assert a.request["tools"] == TOOLS


async def test_async_stream(store: TraceStore) -> None:
    client = _aclient(store)
    async with rollout("as", store=store) as r:
        stream = await client.chat.completions.create(model="m", messages=MSGS, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    [call] = store.calls(r.id)
    assert call.stream and call.is_training and call.response["choices"][0]["message"]["content"] == text


def test_stream_closed_early_is_partial(store: TraceStore) -> None:
    client = _client(store)
    with rollout("early", store=store) as r:
        stream = client.chat.completions.create(model="m", messages=MSGS, stream=True)
        first = next(iter(stream))
        stream.close()
    assert first.choices[0].delta.content
    [call] = store.calls(r.id)
    assert call.partial and not call.is_training and call.finish_reason is None
    assert 0 < len(call.completion_token_ids) < len(tokenize("echo: what is 2+2?"))


def test_raw_response_with_options_and_copy(store: TraceStore) -> None:
    client = _client(store)
    with rollout("raw", store=store) as r:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MSGS)
        assert raw.parse().choices[0].message.content.startswith("echo")
        client.with_options(timeout=5).chat.completions.create(model="m", messages=MSGS)
        client.copy(max_retries=0).chat.completions.create(model="m", messages=MSGS)
    calls = store.calls(r.id)
    assert [c.call_index for c in calls] == [0, 1, 2] and all(c.is_training for c in calls)


def test_legacy_completions(store: TraceStore) -> None:
    client = _client(store)
    with rollout("legacy", store=store) as r:
        out = client.completions.create(model="m", prompt="hello world", max_tokens=30)
    [call] = store.calls(r.id)
    assert call.endpoint == "completions" and call.is_training
    assert call.prompt_token_ids == tuple(tokenize("hello world"))
    assert bytes(call.completion_token_ids).decode() == out.choices[0].text
    assert call.logprobs is not None and len(call.logprobs) == len(call.completion_token_ids)


def test_responses_api_untranslated_is_recorded_without_token_ids(store: TraceStore, caplog) -> None:
    """translate=False: for a server that speaks the Responses API itself (tests/formats: translated)."""
    from lightning_middleware.capture.calls import reset_warnings

    reset_warnings()
    client = wrap(_client(store), translate=False)
    with caplog.at_level(logging.WARNING), rollout("resp", store=store) as r:
        out = client.responses.create(model="m", input="hi there")
    assert out.output_text.startswith("echo")
    [call] = store.calls(r.id)
    assert call.endpoint == "responses" and not call.is_training and call.status_code == 200
    assert call.prompt_token_ids == () and call.response["output"][0]["content"][0]["text"] == out.output_text
    assert "return_token_ids" not in call.request
    assert any("no token IDs" in m for m in caplog.messages)


def test_caller_gets_only_what_it_asked_for(store: TraceStore) -> None:
    client = _client(store)
    with rollout("clean", store=store) as r:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MSGS)
        asked = client.chat.completions.create(model="m", messages=MSGS, logprobs=True)
        events = [json.loads(line[6:]) for line in client.chat.completions.with_raw_response.create(
            model="m", messages=MSGS, stream=True).http_response.iter_lines() if line.startswith("data: {")]
    body = json.loads(raw.http_response.content)
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None
    assert asked.choices[0].logprobs is not None and len(asked.choices[0].logprobs.content) > 0  # its own ask
    assert events and all("token_ids" not in e["choices"][0] for e in events if e["choices"])
    assert all("prompt_token_ids" not in e for e in events)
    calls = store.calls(r.id)  # ... while the store has everything
    assert len(calls) == 3 and all(c.has_token_ids and c.logprobs for c in calls)


def test_credentials_in_the_body_are_never_stored(store: TraceStore) -> None:
    client = _client(store)
    with rollout("secret", store=store) as r:
        client.chat.completions.create(model="m", messages=MSGS, extra_body={
            "api_key": "sk-live-123", "extra_headers": {"Authorization": "Bearer x", "x-trace": "1"}})
    [call] = store.calls(r.id)
    assert "api_key" not in call.request and call.request["extra_headers"] == {"x-trace": "1"}
    with store.engine.connect() as conn:
        assert "sk-live-123" not in str(conn.exec_driver_sql("SELECT request FROM llm_calls").all())


def test_injection_respects_the_caller(store: TraceStore) -> None:
    client = _client(store)
    with rollout("opt-out", store=store) as r:
        client.chat.completions.create(model="m", messages=MSGS, extra_body={"return_token_ids": False})
    with rollout("val", store=store, mode="val") as v:
        client.chat.completions.create(model="m", messages=MSGS)
    [opted_out] = store.calls(r.id)
    assert opted_out.prompt_token_ids == () and not opted_out.is_training
    [val] = store.calls(v.id)
    assert val.has_token_ids and val.logprobs is None  # logprobs only requested when training


def test_unattached_calls(store: TraceStore, tmp_path) -> None:
    client = _client(store)
    client.chat.completions.create(model="m", messages=MSGS)
    store.flush()
    [call] = store.calls(None)
    assert call.rollout_id is None and call.is_training
    quiet_store = TraceStore(f"sqlite:///{tmp_path / 'quiet.db'}")
    quiet = wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="x", http_client=llm_http_client(httpx2)),
                 store=quiet_store, record_unattached=False)
    quiet.chat.completions.create(model="m", messages=MSGS)
    quiet_store.flush()
    assert quiet_store.count("llm_calls") == 0


def test_every_retry_attempt_is_recorded(store: TraceStore) -> None:
    client = _client(store, max_retries=3)
    flaky = f"flaky {uuid.uuid4().hex[:6]}"  # the server counts failures per distinct body
    with rollout("retry", store=store) as r:
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": flaky}],
                                             extra_headers={"x-test-fail-times": "2"})
    assert out.choices[0].message.content == f"echo: {flaky}"
    calls = store.calls(r.id)
    assert [(c.attempt, c.status_code, c.is_training) for c in calls] == [
        (1, 500, False), (2, 500, False), (3, 200, True)]
    assert "injected failure" in calls[0].error
    assert len({c.request_hash for c in calls}) == 1


def test_wrapping_twice_records_once(store: TraceStore) -> None:
    client = _client(store)
    assert wrap(client) is client
    wrap(client, store=store)
    with rollout("twice", store=store) as r:
        client.chat.completions.create(model="m", messages=MSGS)
    assert len(store.calls(r.id)) == 1


def test_header_fallback_attaches_and_is_stripped(store: TraceStore) -> None:
    client = _client(store)
    with rollout("hdr", store=store) as r:
        headers = rollout_headers()
        result: dict = {}

        def outside_context() -> None:  # a plain thread: no ContextVar inherited
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MSGS, extra_headers=headers)
            result["seen"] = raw.headers["x-test-received-headers"]

        t = threading.Thread(target=outside_context)
        t.start()
        t.join()
    assert "x-rollout-id" not in result["seen"].split(",")
    assert len(store.calls(r.id)) == 1


def test_thread_pool_with_propagate(store: TraceStore) -> None:
    client = _client(store)
    with rollout("pool", store=store) as r, concurrent.futures.ThreadPoolExecutor(4) as pool:
        call = propagate(lambda i: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": str(i)}]))
        list(pool.map(call, range(6)))
    assert sorted(c.call_index for c in store.calls(r.id)) == list(range(6))


def test_server_rejecting_extra_fields_never_fails_the_call(store: TraceStore) -> None:
    client = _client(store, default_headers={"x-test-strict": "1"})
    with rollout("strict", store=store) as r:
        first = client.chat.completions.create(model="m", messages=MSGS)
        second = client.chat.completions.create(model="m", messages=MSGS)
    assert first.choices[0].message.content == second.choices[0].message.content == "echo: what is 2+2?"
    calls = store.calls(r.id)
    assert len(calls) == 2 and all(c.status_code == 200 and not c.is_training for c in calls)


def test_a_400_about_the_request_itself_keeps_token_ids_for_later_calls(store: TraceStore) -> None:
    """A 400 that the request as written gets too (a context too long, a bad field of the agent's
    own) is the agent's error, raised as usual; the host is not taken for one that refuses our
    fields, so later calls still carry token IDs and train."""
    client = _client(store)
    with rollout("bad-then-good", store=store) as r:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=MSGS, extra_body={"bogus_field": 1},
                                           extra_headers={"x-test-strict": "1"})
        good = client.chat.completions.create(model="m", messages=MSGS)
    assert good.choices[0].message.content == "echo: what is 2+2?"
    bad, last = store.calls(r.id)[0], store.calls(r.id)[-1]
    assert bad.status_code == 400 and not bad.is_training
    assert last.status_code == 200 and last.is_training and last.completion_token_ids


def test_connection_errors_are_recorded_and_raised_as_usual(store: TraceStore) -> None:
    from lightning_middleware.testing import free_port

    client = wrap(openai.OpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="x", max_retries=1), store=store)
    with pytest.raises(openai.APIConnectionError), rollout("down", store=store) as r:
        client.chat.completions.create(model="m", messages=MSGS)
    calls = store.calls(r.id)
    assert [c.attempt for c in calls] == [1, 2] and all(c.status_code is None and "Connect" in c.error for c in calls)
    ro = store.get_rollout(r.id)
    assert ro.status == "failed" and "APIConnectionError" in ro.error


def test_bare_httpx_client(llm_server: LLMTestServer, store: TraceStore) -> None:
    """Over a real socket: a bare httpx client with its own connection pool."""
    client = wrap(httpx.Client(base_url=llm_server.base_url, timeout=30), store=store)
    with rollout("httpx", store=store) as r:
        resp = client.post("/chat/completions", json={"model": "m", "messages": MSGS})
        assert resp.json()["choices"][0]["message"]["content"] == "echo: what is 2+2?"
        assert client.get("/models").status_code == 200  # not an LLM call: passed through, not recorded
    [call] = store.calls(r.id)
    assert call.is_training


def test_wrap_rejects_unknown_objects_and_bad_stores(tmp_path) -> None:
    from lightning_middleware import StoreError

    with pytest.raises(TypeError, match="does not know how to record"):
        wrap(object())
    with pytest.raises(StoreError):
        wrap(openai.OpenAI(api_key="x"), store=f"sqlite:///{tmp_path}/missing/dir/x.db")


ANSWER = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "prompt_token_ids": [1, 2, 3],
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop",
                       "token_ids": [52], "logprobs": {"content": [{"token": "4", "logprob": -0.5, "bytes": [52]}]}}]}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_response_that_comes_with_its_whole_body_is_recorded(store: TraceStore, asynchronous: bool) -> None:
    """A mock transport (httpx's MockTransport, respx) hands back `Response(json=...)`, its body
    already read and no stream to tee: recorded all the same, and the caller's copy still has
    none of the injected fields."""
    def upstream(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, json=ANSWER)

    url = "http://mock.test/v1"
    with rollout("mocked", store=store) as r:
        if asynchronous:
            aclient = wrap(openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, http_client=httpx2.AsyncClient(
                transport=httpx2.MockTransport(upstream))), store=store)
            raw = asyncio.run(aclient.chat.completions.with_raw_response.create(model="m", messages=MSGS))
        else:
            client = wrap(openai.OpenAI(base_url=url, api_key="x", max_retries=0, http_client=httpx2.Client(
                transport=httpx2.MockTransport(upstream))), store=store)
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MSGS)
    body = json.loads(raw.http_response.content)
    assert raw.parse().choices[0].message.content == "4"
    choice = body["choices"][0]
    assert "prompt_token_ids" not in body and "token_ids" not in choice and not choice["logprobs"]
    [call] = store.calls(r.id)
    assert call.prompt_token_ids == (1, 2, 3) and call.completion_token_ids == (52,) and call.logprobs == (-0.5,)
