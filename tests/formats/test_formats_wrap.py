"""wrap() on the anthropic SDK and on the openai SDK's Responses client, against the test LLM
server (a real HTTP server that speaks only chat completions, as vLLM does for token IDs):
tool calls over several turns, sync and async, streamed and not, recorded as training calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from lightning_middleware import TraceStore, agent_scope, rollout, wrap
from lightning_middleware.testing import TEST_BASE_URL, LLMTestServer, llm_http_client, llm_transport
from lightning_middleware.testing.llm_transport import transport_class
from tests.formats.conversations import (
    QUESTION,
    anthropic_turns,
    anthropic_turns_async,
    check_anthropic_replies,
    check_responses_replies,
    check_training_rollout,
    responses_turns,
    responses_turns_async,
)

KEY = "sk-ant-test-7d1e4f"  # never stored: the conftest scans every store the tests write


@pytest.fixture
def store(tmp_path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'fmt.db'}")
    yield s
    s.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_sdk(llm_server: LLMTestServer, store: TraceStore, stream: bool) -> None:
    client = wrap(anthropic.Anthropic(base_url=llm_server.url, api_key=KEY), store=store)
    with rollout("anthropic-task", store=store) as r:
        replies = anthropic_turns(client, stream=stream)
    check_anthropic_replies(replies)
    first, second = check_training_rollout(store, r.id, "anthropic.messages", stream=stream)
    assert replies[0].id == f"msg_{first.id}" and replies[1].id == f"msg_{second.id}"
    assert first.source_request["system"] == "be brief" and first.source_request["max_tokens"] == 300
    tool_use = second.source_request["messages"][1]["content"][0]
    assert tool_use["type"] == "tool_use" and tool_use["input"] == {"query": QUESTION}
    assert second.request["messages"][2]["tool_calls"][0]["function"]["name"] == "calc"
    assert second.request["messages"][3] == {"role": "tool", "tool_call_id": tool_use["id"], "content": "4"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_async_anthropic_sdk(llm_server: LLMTestServer, store: TraceStore, stream: bool) -> None:
    async with wrap(anthropic.AsyncAnthropic(base_url=llm_server.url, api_key=KEY), store=store) as client, \
            rollout("anthropic-task", store=store) as r:
        replies = await anthropic_turns_async(client, stream=stream)
    check_anthropic_replies(replies)
    check_training_rollout(store, r.id, "anthropic.messages", stream=stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_responses_client(llm_server: LLMTestServer, store: TraceStore, stream: bool) -> None:
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="sk-test"), store=store)
    with rollout("responses-task", store=store) as r:
        replies = responses_turns(client, stream=stream)
    check_responses_replies(replies)
    first, second = check_training_rollout(store, r.id, "responses", stream=stream)
    assert replies[0].id == f"resp_{first.id}"
    assert first.request["messages"][0] == {"role": "system", "content": "be brief"}
    assert [i["type"] for i in second.source_request["input"][1:]] == ["function_call", "function_call_output"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_async_openai_responses_client(llm_server: LLMTestServer, store: TraceStore, stream: bool) -> None:
    async with wrap(openai.AsyncOpenAI(base_url=llm_server.base_url, api_key="sk-test"), store=store) as client, \
            rollout("responses-task", store=store) as r:
        replies = await responses_turns_async(client, stream=stream)
    check_responses_replies(replies)
    check_training_rollout(store, r.id, "responses", stream=stream)


def test_previous_response_id_is_read_back_from_the_store(llm_server: LLMTestServer, store: TraceStore) -> None:
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="sk-test"), store=store)
    with rollout("chained", store=store) as r:
        first = client.responses.create(model="m", instructions="be brief", input=QUESTION,
                                        tools=[{"type": "function", "name": "calc", "parameters": {}}])
        [call] = first.output
        second = client.responses.create(model="m", instructions="be brief", previous_response_id=first.id,
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "4"}])
    assert second.output_text == "echo: 4" and second.previous_response_id == first.id
    calls = check_training_rollout(store, r.id, "responses")
    assert calls[1].request["messages"][:3] == [*calls[0].request["messages"],
                                                {"role": "assistant", "content": None,
                                                 "tool_calls": calls[0].response["choices"][0]["message"][
                                                     "tool_calls"]}]


def test_an_unknown_previous_response_id_is_a_400(store: TraceStore) -> None:
    transport = llm_transport(httpx2)
    client = wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="sk-test", max_retries=0,
                                http_client=httpx2.Client(transport=transport)), store=store)
    with pytest.raises(openai.BadRequestError, match="no response 'resp_nope' in the trace store") as caught:
        client.responses.create(model="m", input="hi", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"
    assert transport.requests == 0  # refused in the process: nothing was sent


def test_what_cannot_be_translated_never_leaves_the_process(store: TraceStore) -> None:
    transport = llm_transport(httpx2)
    client = wrap(anthropic.Anthropic(base_url="http://llm.test", api_key=KEY, max_retries=0,
                                      http_client=httpx2.Client(transport=transport)), store=store)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with rollout("refused", store=store) as r, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="m", max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
    assert caught.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "messages[0].content[1].type: a 'image' block (only text is) cannot be translated to chat completions "
        "faithfully, so it is refused rather than dropped (docs/formats.md)")}}
    assert transport.requests == 0
    store.flush()
    assert store.calls(r.id) == []


def test_translation_is_off_towards_the_vendors_own_api(store: TraceStore) -> None:
    """The in-process transport answers any URL; towards api.openai.com the request goes out as
    the Responses request it is (the vendor speaks it), recorded without token IDs."""
    client = wrap(openai.OpenAI(base_url="https://api.openai.com/v1", api_key="sk-test",
                                http_client=llm_http_client(httpx2)), store=store)
    with rollout("vendor", store=store) as r:
        client.responses.create(model="m", input="hi")
    [call] = store.calls(r.id)
    assert call.endpoint == "responses" and call.source_format is None and not call.is_training
    forced = wrap(openai.OpenAI(base_url="https://api.openai.com/v1", api_key="sk-test",
                                http_client=llm_http_client(httpx2)), store=store, translate=True)
    with rollout("forced", store=store) as r:
        assert forced.responses.create(model="m", input="hi").output_text == "echo: hi"
    [call] = store.calls(r.id)
    assert call.endpoint == "chat.completions" and call.source_format == "responses" and call.is_training


def test_unrecorded_calls_are_still_translated(llm_server: LLMTestServer, store: TraceStore) -> None:
    client = wrap(anthropic.Anthropic(base_url=llm_server.url, api_key=KEY), store=store, record_unattached=False)
    reply = client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    assert reply.content[0].text == "echo: hi" and reply.id.startswith("msg_")
    store.flush()
    assert store.calls(None) == []


def test_translated_calls_go_to_their_agents_policy(store: TraceStore) -> None:
    """Per-agent policies (wrap(policies=...)) apply to the translated chat request: it is sent,
    and recorded, under the agent's served model; recorded or not."""
    def client(**kw: object) -> anthropic.Anthropic:
        return wrap(anthropic.Anthropic(base_url=TEST_BASE_URL, api_key=KEY,
                                        http_client=llm_http_client(httpx2)), store=store, **kw)

    routed = client(policies={"coder": "coder-lora"})
    with rollout("team", store=store) as r:
        with agent_scope("coder"):
            reply = routed.messages.create(model="as-written", max_tokens=20, messages=[{"role": "user",
                                                                                      "content": "hi"}])
        routed.messages.create(model="as-written", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    assert reply.content[0].text == "echo: hi" and reply.model == "as-written"  # the caller's own, echoed
    coder, other = store.calls(r.id)
    assert (coder.model, coder.request["model"], coder.source_request["model"]) == ("coder-lora", "coder-lora",
                                                                                    "as-written")
    assert other.model == "as-written" and coder.is_training and other.is_training

    class Seen(transport_class(httpx2)):  # type: ignore[misc]
        """The test LLM, keeping the bodies it was sent (what left the process)."""

        bodies: list[dict] = []

        def handle_request(self, request: Any) -> Any:
            request.read()
            self.bodies.append(json.loads(request.content))
            return super().handle_request(request)

    unrecorded = wrap(anthropic.Anthropic(base_url=TEST_BASE_URL, api_key=KEY,
                                          http_client=httpx2.Client(transport=Seen())),
                      store=store, record_unattached=False, policies={"coder": "coder-lora"})
    with agent_scope("coder"):
        unrecorded.messages.create(model="as-written", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    [sent] = Seen.bodies
    assert sent["model"] == "coder-lora" and sent["messages"] == [{"role": "user", "content": "hi"}]
    store.flush()
    assert store.calls(None) == []
