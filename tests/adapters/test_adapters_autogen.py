"""AutoGen adapter: OpenAIChatCompletionClient, AssistantAgent tool loops, teams, rebuilt clients."""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_agentchat.conditions import MaxMessageTermination  # noqa: E402
from autogen_agentchat.teams import RoundRobinGroupChat  # noqa: E402
from autogen_core.models import ChatCompletionClient, CreateResult, SystemMessage, UserMessage  # noqa: E402
from autogen_ext.models.openai import OpenAIChatCompletionClient  # noqa: E402

from lightning_middleware import TraceStore, rollout, rollout_headers, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer, render_chat, tokenize  # noqa: E402

MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
              "structured_output": False}


def _client(server: LLMTestServer, store: TraceStore, **kw) -> OpenAIChatCompletionClient:
    return wrap(OpenAIChatCompletionClient(model="m", base_url=server.base_url, api_key="sk-test",
                                           model_info=MODEL_INFO, **kw), store=store)


async def calc(query: str) -> str:
    """Evaluate a math question."""
    return "4"


async def test_create_and_create_stream(llm_server: LLMTestServer, store: TraceStore) -> None:
    client = _client(llm_server, store)
    msgs = [SystemMessage(content="be brief"), UserMessage(content="what is 2+2?", source="user")]
    async with rollout("ag-create", store=store) as r:
        out = await client.create(msgs)
        pieces = [p async for p in client.create_stream(msgs)]
    assert out.content == "echo: what is 2+2?"
    assert isinstance(pieces[-1], CreateResult) and "".join(p for p in pieces[:-1]) == out.content
    plain, streamed = store.calls(r.id)
    prompt = render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}])
    assert plain.prompt_token_ids == tuple(tokenize(prompt)) == streamed.prompt_token_ids
    assert plain.completion_token_ids == streamed.completion_token_ids == tuple(tokenize(out.content))
    assert plain.is_training and streamed.is_training and streamed.stream and plain.agent_name is None


async def test_assistant_agent_tool_loop_with_reflection(llm_server: LLMTestServer, store: TraceStore) -> None:
    agent = AssistantAgent("solver", model_client=_client(llm_server, store), tools=[calc],
                           reflect_on_tool_use=True)
    async with rollout("ag-agent", store=store) as r:
        result = await agent.run(task="what is 2+2?")
    assert result.messages[-1].content == "echo: 4"
    first, second = store.calls(r.id)
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert second.request["messages"][-1]["role"] == "tool"
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert first.agent_name == second.agent_name == "solver"


async def test_round_robin_team_names_each_agent(llm_server: LLMTestServer, store: TraceStore) -> None:
    client = _client(llm_server, store)
    writer = AssistantAgent("writer", model_client=client, system_message="write")
    critic = AssistantAgent("critic", model_client=client, system_message="criticise")
    team = RoundRobinGroupChat([writer, critic], termination_condition=MaxMessageTermination(5))
    async with rollout("ag-team", store=store) as r:
        result = await team.run(task="a haiku")
    assert len(result.messages) == 5
    calls = store.calls(r.id)
    assert [c.agent_name for c in calls] == ["writer", "critic", "writer", "critic"]
    assert all(c.is_training for c in calls)


async def test_run_stream_and_wrap_of_an_agent(llm_server: LLMTestServer, store: TraceStore) -> None:
    raw = OpenAIChatCompletionClient(model="m", base_url=llm_server.base_url, api_key="k", model_info=MODEL_INFO)
    agent = AssistantAgent("streamer", model_client=raw, model_client_stream=True)
    assert wrap(agent, store=store) is agent  # wrap() of an agent wraps its model client
    async with rollout("ag-stream", store=store) as r:
        items = [m async for m in agent.run_stream(task="hello")]
    assert items[-1].messages[-1].content == "echo: hello"
    [call] = store.calls(r.id)
    assert call.stream and call.is_training and call.agent_name == "streamer"


async def test_rebuilt_clients_keep_recording(llm_server: LLMTestServer, store: TraceStore) -> None:
    client = _client(llm_server, store)
    config = client.dump_component()
    assert "x-lightning-capture" in config.config["default_headers"]
    loaded = ChatCompletionClient.load_component(config)
    pickled = pickle.loads(pickle.dumps(client))
    copied = copy.deepcopy(client)
    unwrapped = OpenAIChatCompletionClient(model="m", base_url=llm_server.base_url, api_key="k", model_info=MODEL_INFO)
    assert "default_headers" not in unwrapped.dump_component().config  # unrecorded clients dump unchanged
    async with rollout("ag-rebuilt", store=store) as r:
        for c in (loaded, pickled, copied):
            await c.create([UserMessage(content="hi", source="user")])
        await unwrapped.create([UserMessage(content="not recorded", source="user")])
    calls = store.calls(r.id)
    assert len(calls) == 3 and all(c.is_training for c in calls)
    raw = await loaded._client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "h"}])
    assert "x-lightning-capture" not in raw.headers["x-test-received-headers"].split(",")


def test_config_from_another_process_fails_loudly(llm_server: LLMTestServer, store: TraceStore) -> None:
    config = _client(llm_server, store).dump_component()
    config.config["default_headers"]["x-lightning-capture"] = "unknown-token"
    with pytest.raises(RuntimeError, match="call lightning_middleware.capture.wrap"):
        ChatCompletionClient.load_component(config)


def test_runtime_outside_the_rollout_uses_the_header(llm_server: LLMTestServer, store: TraceStore) -> None:
    with rollout("ag-header", store=store) as r:
        headers = rollout_headers()
    # an agent runtime in its own thread and event loop, configured with the rollout's header
    client = _client(llm_server, store, default_headers=headers)
    agent = AssistantAgent("remote", model_client=client)
    t = threading.Thread(target=lambda: asyncio.run(agent.run(task="hi")))
    t.start()
    t.join()
    store.flush()
    [call] = store.calls(r.id)
    assert call.agent_name == "remote" and call.is_training
