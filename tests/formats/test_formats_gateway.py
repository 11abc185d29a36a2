"""The gateway's /v1/messages and /v1/responses, with the real anthropic SDK and the real openai
SDK's Responses client in front and the test LLM server (chat completions only) behind: tool
calls over several turns, streamed and not, recorded as training calls with merged turns."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from lightning_middleware import TraceStore
from lightning_middleware.gateway import Gateway
from lightning_middleware.testing import LLMTestServer
from tests.formats.conversations import (
    anthropic_turns,
    anthropic_turns_async,
    check_anthropic_replies,
    check_responses_replies,
    check_training_rollout,
    responses_turns,
    responses_turns_async,
)
from tests.formats.streams import events


@pytest.fixture
def store(tmp_path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'gwfmt.db'}")
    yield s
    s.close()


@pytest.fixture
def gw(llm_server: LLMTestServer, store: TraceStore) -> Iterator[Gateway]:
    with Gateway([llm_server.base_url], store, health_interval_s=0) as g:
        yield g


def _rollout(gw: Gateway) -> str:
    r = httpx.post(gw.url + "/rollouts", json={"task_id": "t"}, timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _finish(gw: Gateway, rid: str) -> None:
    """Finish the rollout: the gateway waits for its calls (a stream's record follows its last byte)."""
    assert httpx.post(f"{gw.url}/rollouts/{rid}/finish", json={"reward": 1.0}, timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_sdk_through_the_gateway(gw: Gateway, store: TraceStore, stream: bool) -> None:
    rid = _rollout(gw)
    client = anthropic.Anthropic(base_url=f"{gw.url}/rollouts/{rid}", api_key="-")  # posts to .../v1/messages
    replies = anthropic_turns(client, stream=stream)
    check_anthropic_replies(replies)
    _finish(gw, rid)
    calls = check_training_rollout(store, rid, "anthropic.messages", stream=stream)
    assert [r.id for r in replies] == [f"msg_{c.id}" for c in calls]


async def test_async_anthropic_sdk_streams_through_the_gateway(gw: Gateway, store: TraceStore) -> None:
    rid = _rollout(gw)
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="-", default_headers={"x-rollout-id": rid}) as client:
        check_anthropic_replies(await anthropic_turns_async(client, stream=True))
    _finish(gw, rid)
    check_training_rollout(store, rid, "anthropic.messages", stream=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_responses_client_through_the_gateway(gw: Gateway, store: TraceStore, stream: bool) -> None:
    rid = _rollout(gw)
    client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="-")
    replies = responses_turns(client, stream=stream)
    check_responses_replies(replies)
    _finish(gw, rid)
    calls = check_training_rollout(store, rid, "responses", stream=stream)
    assert [r.id for r in replies] == [f"resp_{c.id}" for c in calls]


async def test_async_openai_responses_client_through_the_gateway(gw: Gateway, store: TraceStore) -> None:
    rid = _rollout(gw)
    async with openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key="-") as client:
        check_responses_replies(await responses_turns_async(client, stream=False))
    _finish(gw, rid)
    check_training_rollout(store, rid, "responses", stream=False)


def test_previous_response_id_through_the_gateway(gw: Gateway, store: TraceStore) -> None:
    rid = _rollout(gw)
    client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="-")
    first = client.responses.create(model="m", input="what is 2+2?", instructions="be brief",
                                    tools=[{"type": "function", "name": "calc", "parameters": {}}])
    second = client.responses.create(model="m", instructions="be brief", previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "4"}])
    assert second.output_text == "echo: 4"
    _finish(gw, rid)
    check_training_rollout(store, rid, "responses")


def test_a_stream_is_relayed_as_the_engine_writes_it(gw: Gateway, store: TraceStore) -> None:
    """The test server waits 0.2 s before each chunk: the caller's first events arrive long before
    the answer is done (a buffered replay would deliver everything at the end)."""
    import time

    rid = _rollout(gw)
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hello there"}]}
    started = time.monotonic()
    arrivals = []
    with httpx.stream("POST", f"{gw.url}/rollouts/{rid}/v1/messages", json=body,
                      headers={"x-test-delay": "0.2"}, timeout=30) as r:
        for chunk in r.iter_raw():
            arrivals.append((time.monotonic() - started, chunk))
    kinds = [e for e, _ in events(b"".join(c for _, c in arrivals))]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    first_delta = next(t for t, c in arrivals if b"content_block_delta" in c)
    assert arrivals[-1][0] - first_delta > 0.5
    _finish(gw, rid)
    check_training_rollout(store, rid, "anthropic.messages", turns=1, stream=True)


def test_refused_requests_name_the_field_in_the_callers_format(gw: Gateway, store: TraceStore) -> None:
    rid = _rollout(gw)
    a = anthropic.Anthropic(base_url=f"{gw.url}/rollouts/{rid}", api_key="-", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        a.messages.create(model="m", max_tokens=10, thinking={"type": "enabled", "budget_tokens": 1024},
                          messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["message"].startswith("thinking:")
    o = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        o.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert refused.value.body["param"] == "input[0].content[0].type"
    with pytest.raises(openai.BadRequestError, match="no response 'resp_gone'"):
        o.responses.create(model="m", input="hi", previous_response_id="resp_gone")
    store.flush()
    assert store.calls(rid) == []  # nothing went upstream


def test_a_gateway_error_is_in_the_callers_format(gw: Gateway) -> None:
    r = httpx.post(f"{gw.url}/rollouts/no-such-rollout/v1/messages", json={"model": "m", "messages": []}, timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error" and "no-such-rollout" in r.json()["error"]["message"]


def test_a_retried_stream_is_replayed_in_the_callers_format(gw: Gateway, store: TraceStore) -> None:
    rid = _rollout(gw)
    body = {"model": "m", "input": "hi", "stream": True}
    url = f"{gw.rollout_base_url(rid)}/responses"
    first = httpx.post(url, json=body, headers={"idempotency-key": "k1"}, timeout=30)
    again = httpx.post(url, json=body, headers={"idempotency-key": "k1"}, timeout=30)
    assert again.headers["x-lightning-replayed"] == "1" and again.content == first.content
    assert [e for e, _ in events(first.content)][-1] == "response.completed"
    _finish(gw, rid)
    check_training_rollout(store, rid, "responses", turns=1, stream=True)


def test_without_translation_the_formats_go_upstream_as_they_are(llm_server: LLMTestServer, store: TraceStore
                                                                 ) -> None:
    with Gateway([llm_server.base_url], store, health_interval_s=0, translate=False) as gw:
        rid = _rollout(gw)
        out = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="-").responses.create(model="m", input="hi")
    assert out.id == "resp_test"  # the test server's own Responses answer
    store.flush()
    [call] = store.calls(rid)
    assert call.endpoint == "responses" and call.source_format is None and not call.is_training
    assert json.loads(json.dumps(call.request)) == {"model": "m", "input": "hi"}


def test_translated_calls_go_to_their_agents_policy(llm_server: LLMTestServer, store: TraceStore) -> None:
    """The gateway's per-agent policies (`--policy`) apply to the translated chat request."""
    with Gateway([llm_server.base_url], store, health_interval_s=0, policies={"coder": "coder-lora"},
                 default_policy="base") as g:
        rid = _rollout(g)
        for agent in ("coder", "planner"):
            client = anthropic.Anthropic(base_url=f"{g.url}/rollouts/{rid}", api_key="-",
                                         default_headers={"x-agent-name": agent})
            reply = client.messages.create(model="as-written", max_tokens=20,
                                           messages=[{"role": "user", "content": "hi"}])
            assert reply.content[0].text == "echo: hi"
        _finish(g, rid)
    coder, planner = store.calls(rid)
    assert (coder.model, coder.request["model"], coder.source_request["model"]) == ("coder-lora", "coder-lora",
                                                                                    "as-written")
    assert planner.model == "base" and coder.is_training and planner.is_training
