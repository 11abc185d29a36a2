"""OpenAI Agents SDK adapter: Runner.run / run_streamed / run_sync, tools, handoffs, chat completions."""

from __future__ import annotations

import logging

import openai
import pytest

pytest.importorskip("agents")

from agents import (  # noqa: E402
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from lightning_middleware import TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer, tokenize  # noqa: E402

set_tracing_disabled(True)  # no trace export: no network


def _model(server: LLMTestServer, store: TraceStore) -> OpenAIChatCompletionsModel:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test")
    return wrap(OpenAIChatCompletionsModel(model="m", openai_client=client), store=store)


@function_tool
def calc(query: str) -> str:
    """Evaluate a math question."""
    return "4"


async def test_run_with_function_tool(llm_server: LLMTestServer, store: TraceStore) -> None:
    agent = Agent(name="solver", instructions="be brief", model=_model(llm_server, store), tools=[calc])
    async with rollout("ag-sdk-run", store=store) as r:
        result = await Runner.run(agent, "what is 2+2?")
    assert result.final_output == "echo: 4"
    first, second = store.calls(r.id)
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert second.completion_token_ids == tuple(tokenize("echo: 4"))
    assert first.is_training and second.is_training
    assert first.agent_name == second.agent_name == "solver"


async def test_run_streamed(llm_server: LLMTestServer, store: TraceStore) -> None:
    agent = Agent(name="streamer", model=_model(llm_server, store), tools=[calc])
    async with rollout("ag-sdk-stream", store=store) as r:
        result = Runner.run_streamed(agent, "what is 2+2?")
        events = [e async for e in result.stream_events()]
    assert events and result.final_output == "echo: 4"
    calls = store.calls(r.id)
    assert len(calls) == 2 and all(c.stream and c.is_training for c in calls)
    assert [c.agent_name for c in calls] == ["streamer", "streamer"]


def test_run_sync(llm_server: LLMTestServer, store: TraceStore) -> None:
    agent = Agent(name="sync", model=_model(llm_server, store))
    with rollout("ag-sdk-sync", store=store) as r:
        result = Runner.run_sync(agent, "hello")
    assert result.final_output == "echo: hello"
    [call] = store.calls(r.id)
    assert call.is_training and call.agent_name == "sync"


async def test_handoff_between_two_agents(llm_server: LLMTestServer, store: TraceStore) -> None:
    model = _model(llm_server, store)
    specialist = Agent(name="specialist", instructions="answer", model=model)
    triage = Agent(name="triage", instructions="route", model=model, handoffs=[specialist])
    async with rollout("ag-sdk-handoff", store=store) as r:
        result = await Runner.run(triage, "need help")
    assert result.last_agent.name == "specialist"
    calls = store.calls(r.id)
    assert [c.agent_name for c in calls] == ["triage", "specialist"]
    assert calls[0].finish_reason == "tool_calls"
    assert calls[0].response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "transfer_to_specialist"
    assert all(c.is_training for c in calls)


async def test_default_client_and_wrap_of_agent(llm_server: LLMTestServer, store: TraceStore) -> None:
    from agents import set_default_openai_api, set_default_openai_client
    from agents.models import _openai_shared

    client = wrap(openai.AsyncOpenAI(base_url=llm_server.base_url, api_key="sk-test"), store=store)
    saved = (_openai_shared.get_default_openai_client(), _openai_shared.get_use_responses_by_default())
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("chat_completions")
    try:
        agent = Agent(name="default", model="m")
        with pytest.raises(TypeError, match="set_default_openai_client"):
            wrap(agent)
        async with rollout("ag-sdk-default", store=store) as r:
            result = await Runner.run(agent, "hi")
    finally:
        _openai_shared.set_default_openai_client(saved[0])
        _openai_shared.set_use_responses_by_default(saved[1])
    assert result.final_output == "echo: hi"
    [call] = store.calls(r.id)
    assert call.endpoint == "chat.completions" and call.is_training and call.agent_name == "default"
    other = Agent(name="x", model=OpenAIChatCompletionsModel(model="m", openai_client=openai.AsyncOpenAI(
        base_url=llm_server.base_url, api_key="k")))
    assert wrap(other, store=store) is other


async def test_responses_api_untranslated_is_recorded_with_a_warning(llm_server: LLMTestServer, store: TraceStore,
                                                                     caplog) -> None:
    """translate=False (a server that speaks the Responses API itself): recorded, not trainable."""
    from lightning_middleware.capture.calls import reset_warnings

    reset_warnings()
    client = openai.AsyncOpenAI(base_url=llm_server.base_url, api_key="sk-test")
    model = wrap(OpenAIResponsesModel(model="m", openai_client=client), store=store, translate=False)
    agent = Agent(name="resp", model=model)
    with caplog.at_level(logging.WARNING):
        async with rollout("ag-sdk-responses", store=store) as r:
            await Runner.run(agent, "hi")
    [call] = store.calls(r.id)
    assert call.endpoint == "responses" and not call.is_training and call.status_code == 200
    assert call.agent_name == "resp"
    assert any("carry no token IDs" in m for m in caplog.messages)


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_default_model_settings_responses_train_with_merged_turns(llm_server: LLMTestServer, store: TraceStore,
                                                                      streamed: bool) -> None:
    """The SDK as it comes: its default model over the Responses API (no model object, no
    set_default_openai_api). wrap() translates each turn to chat completions, so every turn is a
    training call and the turns merge into one row."""
    from agents import set_default_openai_client
    from agents.models import _openai_shared

    from lightning_middleware.rows import build_rows_for_rollouts

    saved = (_openai_shared.get_default_openai_client(), _openai_shared.get_use_responses_by_default())
    async with wrap(openai.AsyncOpenAI(base_url=llm_server.base_url, api_key="sk-test"), store=store) as client:
        set_default_openai_client(client, use_for_tracing=False)
        _openai_shared.set_use_responses_by_default(True)  # the SDK's default (other tests change it)
        try:
            agent = Agent(name="solver", instructions="be brief", tools=[calc])
            async with rollout("ag-sdk-responses-default", store=store) as r:
                if streamed:
                    result = Runner.run_streamed(agent, "what is 2+2?")
                    kinds = {e.type async for e in result.stream_events()}
                    assert "raw_response_event" in kinds
                else:
                    result = await Runner.run(agent, "what is 2+2?")
        finally:
            _openai_shared.set_default_openai_client(saved[0])
            _openai_shared.set_use_responses_by_default(saved[1])
    assert result.final_output == "echo: 4"
    first, second = calls = store.calls(r.id)
    assert all(c.endpoint == "chat.completions" and c.source_format == "responses" and c.is_training for c in calls)
    assert all(c.agent_name == "solver" and c.stream == streamed for c in calls)
    assert first.finish_reason == "tool_calls" and second.completion_token_ids == tuple(tokenize("echo: 4"))
    assert [i.get("type", "message") for i in second.source_request["input"]] == [
        "message", "function_call", "function_call_output"]
    rollout_record = store.get_rollout(r.id)
    assert rollout_record is not None
    rows, stats = build_rows_for_rollouts([(rollout_record, calls)])
    assert len(rows) == 1 and stats.prefix_breaks == 0 and stats.merges == 1
    assert sum(rows[0].loss_mask) == len(first.completion_token_ids) + len(second.completion_token_ids)
