"""The translation against the real vLLM CPU server: the real `anthropic` SDK and the real openai
SDK's Responses client, streamed and whole, through the gateway and through wrap(), three turns
each with a tool call and its result in between. The SDKs parse every answer, and the token IDs
recorded for each translated call are vLLM's own tokenization of the translated prompt (0 drift).

The tiny random model writes no tool call of its own accord: the first turn names the tool
(`tool_choice`), so the engine writes the call; the second sends its result back; the third
continues (the Responses API by `previous_response_id`, resolved from the trace store).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from lightning_middleware import LLMCall, TraceStore, rollout, wrap
from lightning_middleware.gateway import Gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
# The engine writes the named call in the model's hermes form; the tiny model's arguments run for a
# few dozen tokens. With this seed it closes the call (the turn ends "stop") on this prompt, which
# both formats translate to the same chat request.
TOOL_TURN = {"max_tokens": 60, "seed": 2}
QUESTION = "weather in paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "the weather in a city", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
                    "parameters": SCHEMA}]
# anthropic 2.x has no sampling parameters of its own: extra_body sends them, and they pass to vLLM as they are.
ANTHROPIC_KW = {"model": "tiny", "system": "be brief", "tools": ANTHROPIC_TOOLS}
RESPONSES_KW = {"model": "tiny", "instructions": "be brief", "tools": RESPONSES_TOOLS, "temperature": 1.0}


@pytest.fixture
def store(tmp_path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'vllm-fmt.db'}")
    yield s
    s.close()


@pytest.fixture
def base_weights(vllm_server, tied_checkpoints) -> None:
    """Other tests swap weights into the shared server: serve the base weights the tokenizer belongs to."""
    from trainer_backend.serving.publisher import WeightPublisher

    WeightPublisher(vllm_server.url).publish(tied_checkpoints.base, "formats")


@pytest.fixture
def gw(vllm_server, base_weights, store: TraceStore) -> Iterator[Gateway]:
    with Gateway([vllm_server.base_url], store, health_interval_s=0) as g:
        yield g


def _tokenize(server, request: dict[str, Any]) -> tuple[int, ...]:
    """vLLM's own tokenization of a chat request's prompt (messages, tools, prefill flags)."""
    body = {"model": "tiny", "messages": request["messages"]}
    for key in ("tools", "add_generation_prompt", "continue_final_message"):
        if key in request:
            body[key] = request[key]
    out = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert out.status_code == 200, out.text
    return tuple(out.json()["tokens"])


def _no_drift(server, store: TraceStore, rollout_id: str, source_format: str, stream: bool) -> list[LLMCall]:
    store.flush()
    calls = store.calls(rollout_id)
    assert [c.call_index for c in calls] == [0, 1, 2]
    for c in calls:
        assert c.is_training and c.endpoint == "chat.completions" and c.source_format == source_format
        assert c.stream == stream and c.source_request is not None
        assert c.prompt_token_ids == _tokenize(server, c.request), f"drift in call {c.call_index}"
        assert c.completion_token_ids and c.logprobs is not None
        assert len(c.logprobs) == len(c.completion_token_ids)
    # The engine's tool call went back into the prompt as a tool call, its result as a tool message.
    second = calls[1].request["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert second[3]["tool_call_id"] == second[2]["tool_calls"][0]["id"]
    return calls


# --------------------------------------------------------------------------
# Anthropic Messages
# --------------------------------------------------------------------------

def _anthropic_call(client: anthropic.Anthropic, stream: bool, messages: list[Any], tool_turn: bool = False) -> Any:
    kw: dict[str, Any] = {**ANTHROPIC_KW, "messages": messages, "max_tokens": MAX_TOKENS,
                          "extra_body": {"temperature": 1.0}}
    if tool_turn:
        kw.update(max_tokens=TOOL_TURN["max_tokens"], tool_choice={"type": "tool", "name": "get_weather"},
                  extra_body={"temperature": 1.0, "seed": TOOL_TURN["seed"]})
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        kinds = [event.type for event in s]
        reply = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    return reply


def anthropic_turns(client: anthropic.Anthropic, stream: bool) -> list[Any]:
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    first = _anthropic_call(client, stream, messages, tool_turn=True)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input, dict)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny"}
                                              for b in uses]}]
    second = _anthropic_call(client, stream, messages)
    messages += [{"role": "assistant", "content": second.content or "..."},
                 {"role": "user", "content": "and tomorrow?"}]
    third = _anthropic_call(client, stream, messages)
    for reply in (first, second, third):
        assert reply.type == "message" and reply.role == "assistant" and reply.usage.output_tokens > 0
        assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    return [first, second, third]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_sdk_through_the_gateway(vllm_server, gw: Gateway, store: TraceStore, stream: bool) -> None:
    rid = httpx.post(gw.url + "/rollouts", json={"task_id": "fmt-vllm"}, timeout=30).json()["id"]
    replies = anthropic_turns(anthropic.Anthropic(base_url=f"{gw.url}/rollouts/{rid}", api_key="-"), stream)
    assert httpx.post(f"{gw.url}/rollouts/{rid}/finish", json={"reward": 1.0}, timeout=60).status_code == 200
    calls = _no_drift(vllm_server, store, rid, "anthropic.messages", stream)
    assert [r.id for r in replies] == [f"msg_{c.id}" for c in calls]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_sdk_wrapped(vllm_server, base_weights, store: TraceStore, stream: bool) -> None:
    client = wrap(anthropic.Anthropic(base_url=vllm_server.url, api_key="-"), store=store)  # no /v1
    with rollout("fmt-vllm-anthropic", store=store) as r:
        replies = anthropic_turns(client, stream)
    calls = _no_drift(vllm_server, store, r.id, "anthropic.messages", stream)
    assert [rep.id for rep in replies] == [f"msg_{c.id}" for c in calls]


# --------------------------------------------------------------------------
# The Responses API
# --------------------------------------------------------------------------

def _responses_call(client: openai.OpenAI, stream: bool, tool_turn: bool = False, **kw: Any) -> Any:
    kw = {**RESPONSES_KW, "max_output_tokens": MAX_TOKENS, **kw}
    if tool_turn:
        kw.update(max_output_tokens=TOOL_TURN["max_tokens"], tool_choice={"type": "function", "name": "get_weather"},
                  extra_body={"seed": TOOL_TURN["seed"]})
    if not stream:
        return client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        evs = list(s)
    # An answer cut at max_output_tokens ends in `response.incomplete`, as the API's does (the SDK's
    # get_final_response() wants `response.completed`): the last event carries the response either way.
    assert evs[0].type == "response.created" and evs[-1].type in ("response.completed", "response.incomplete")
    return evs[-1].response


def responses_turns(client: openai.OpenAI, stream: bool) -> list[Any]:
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    first = _responses_call(client, stream, tool_turn=True, input=items)
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    items += [*(i.model_dump(exclude_none=True) for i in first.output),
              *({"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls)]
    second = _responses_call(client, stream, input=items)
    third = _responses_call(client, stream, input="and tomorrow?", previous_response_id=second.id)
    for reply in (first, second, third):
        assert reply.object == "response" and reply.usage.output_tokens > 0
        assert reply.status in ("completed", "incomplete")
    return [first, second, third]


def _check_continued(calls: list[LLMCall]) -> None:
    """The third turn's prompt is the second's plus its answer, from the store, then the new input."""
    second, third = calls[1].request["messages"], calls[2].request["messages"]
    assert third[: len(second)] == second and third[-1] == {"role": "user", "content": "and tomorrow?"}
    assert third[len(second)]["role"] == "assistant"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_client_through_the_gateway(vllm_server, gw: Gateway, store: TraceStore, stream: bool) -> None:
    rid = httpx.post(gw.url + "/rollouts", json={"task_id": "fmt-vllm"}, timeout=30).json()["id"]
    replies = responses_turns(openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="-"), stream)
    assert httpx.post(f"{gw.url}/rollouts/{rid}/finish", json={"reward": 1.0}, timeout=60).status_code == 200
    calls = _no_drift(vllm_server, store, rid, "responses", stream)
    assert [r.id for r in replies] == [f"resp_{c.id}" for c in calls]
    _check_continued(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_client_wrapped(vllm_server, base_weights, store: TraceStore, stream: bool) -> None:
    client = wrap(openai.OpenAI(base_url=vllm_server.base_url, api_key="-"), store=store)
    with rollout("fmt-vllm-responses", store=store) as r:
        replies = responses_turns(client, stream)
    calls = _no_drift(vllm_server, store, r.id, "responses", stream)
    assert [rep.id for rep in replies] == [f"resp_{c.id}" for c in calls]
    _check_continued(calls)
