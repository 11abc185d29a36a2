"""Every framework's real agent loop: two tools, three LLM turns, streaming too; and no cross-over.

The test server's `multi-tool` model calls each offered tool once, in order, then
answers: a loop of exactly three LLM turns whose prompts each extend the last.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os

import openai
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

from lightning_middleware import LLMCall, TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402

MODEL = "multi-tool"
AUTOGEN_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
                "structured_output": False}
ran: list[str] = []
_distinct = itertools.count()


def lookup_fn(query: str) -> str:
    ran.append("lookup")
    return "paris"


def weather_fn(query: str) -> str:
    ran.append("weather")
    return "sunny"


def assert_three_turn_loop(calls: list[LLMCall], *, agent: str | None, streamed: bool = False) -> None:
    """In order, in one rollout, tool calls then an answer, each prompt extending the last."""
    assert [c.call_index for c in calls] == [0, 1, 2]
    assert all(c.is_training and c.has_token_ids and c.logprobs for c in calls)
    assert [c.finish_reason for c in calls] == ["tool_calls", "tool_calls", "stop"]
    names = [c.response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] for c in calls[:2]]
    assert names == ["lookup", "weather"]
    assert calls[2].response["choices"][0]["message"]["content"].startswith("echo: ")
    for earlier, later in zip(calls, calls[1:]):
        head = earlier.prompt_token_ids + earlier.completion_token_ids
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
        assert len(later.prompt_token_ids) > len(head)  # the tool result came in between
        assert [m["role"] for m in later.request["messages"]][-1] == "tool"
        assert len(later.request["tools"]) == 2
    assert all(c.agent_name == agent for c in calls)
    if streamed:
        assert all(c.stream for c in calls)


# ----------------------------------------------------------------- LangChain

def _langchain_agent(server: LLMTestServer, store: TraceStore, name: str, streaming: bool = False):
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    lookup = tool("lookup", description="Look a fact up.")(lookup_fn)
    weather = tool("weather", description="Get the weather.")(weather_fn)
    # langchain-openai caches its async HTTP client per (base_url, timeout), and a cached async
    # client can't outlive the event loop of the test that made it: a distinct timeout each time.
    model = wrap(ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="k", streaming=streaming,
                            timeout=70 + next(_distinct) / 1000), store=store)
    return create_agent(model, tools=[lookup, weather], name=name)


@pytest.mark.parametrize("streaming", [False, True])
def test_langchain_two_tools_three_turns(llm_server: LLMTestServer, store: TraceStore, streaming: bool) -> None:
    pytest.importorskip("langchain")
    ran.clear()
    agent = _langchain_agent(llm_server, store, "planner", streaming)
    with rollout("lc-loop", store=store) as r:
        result = agent.invoke({"messages": [{"role": "user", "content": "capital of france and weather?"}]})
    assert ran == ["lookup", "weather"] and result["messages"][-1].content == "echo: sunny"
    assert_three_turn_loop(store.calls(r.id), agent="planner", streamed=streaming)


# ----------------------------------------------------------------- AutoGen

def _autogen_agent(server: LLMTestServer, store: TraceStore, name: str, streaming: bool = False):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    async def lookup(query: str) -> str:
        """Look a fact up."""
        return lookup_fn(query)

    async def weather(query: str) -> str:
        """Get the weather."""
        return weather_fn(query)

    client = wrap(OpenAIChatCompletionClient(model=MODEL, base_url=server.base_url, api_key="k",
                                             model_info=AUTOGEN_INFO), store=store)
    # max_tool_iterations lets one run go tool -> tool -> answer, as an agent loop does.
    return AssistantAgent(name, model_client=client, tools=[lookup, weather], max_tool_iterations=5,
                          model_client_stream=streaming, reflect_on_tool_use=True)


@pytest.mark.parametrize("streaming", [False, True])
async def test_autogen_two_tools_three_turns(llm_server: LLMTestServer, store: TraceStore, streaming: bool) -> None:
    pytest.importorskip("autogen_agentchat")
    ran.clear()
    agent = _autogen_agent(llm_server, store, "planner", streaming)
    async with rollout("ag-loop", store=store) as r:
        result = await agent.run(task="capital of france and weather?")
    assert ran == ["lookup", "weather"] and result.messages[-1].content == "echo: sunny"
    assert_three_turn_loop(store.calls(r.id), agent="planner", streamed=streaming)


# ----------------------------------------------------------------- OpenAI Agents SDK

def _agents_sdk_agent(server: LLMTestServer, store: TraceStore, name: str):
    from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    lookup = function_tool(lookup_fn, name_override="lookup", description_override="Look a fact up.")
    weather = function_tool(weather_fn, name_override="weather", description_override="Get the weather.")
    model = wrap(OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.base_url, api_key="k")), store=store)
    return Agent(name=name, instructions="be brief", model=model, tools=[lookup, weather])


@pytest.mark.parametrize("streaming", [False, True])
async def test_agents_sdk_two_tools_three_turns(llm_server: LLMTestServer, store: TraceStore, streaming: bool) -> None:
    pytest.importorskip("agents")
    from agents import Runner

    ran.clear()
    agent = _agents_sdk_agent(llm_server, store, "planner")
    async with rollout("sdk-loop", store=store) as r:
        if streaming:
            run = Runner.run_streamed(agent, "capital of france and weather?")
            async for _ in run.stream_events():
                pass
            final = run.final_output
        else:
            final = (await Runner.run(agent, "capital of france and weather?")).final_output
    assert ran == ["lookup", "weather"] and final == "echo: sunny"
    assert_three_turn_loop(store.calls(r.id), agent="planner", streamed=streaming)


# ----------------------------------------------------------------- LiteLLM

TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    for n, d in (("lookup", "Look a fact up."), ("weather", "Get the weather."))]


async def _litellm_loop(server: LLMTestServer, question: str, streaming: bool) -> str:
    """A hand-written LiteLLM tool loop, as users write them."""
    import litellm

    fns = {"lookup": lookup_fn, "weather": weather_fn}
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(5):
        kw = dict(model=f"hosted_vllm/{MODEL}", api_base=server.base_url, messages=messages, tools=TOOLS)
        if streaming:
            chunks = [c async for c in await litellm.acompletion(**kw, stream=True)]
            message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
        else:
            message = (await litellm.acompletion(**kw)).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for tc in message.tool_calls:
            out = fns[tc.function.name](**json.loads(tc.function.arguments))
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    raise AssertionError("loop did not finish")


@pytest.mark.parametrize("streaming", [False, True])
async def test_litellm_two_tools_three_turns(llm_server: LLMTestServer, store: TraceStore, streaming: bool) -> None:
    litellm = pytest.importorskip("litellm")
    from lightning_middleware import agent_scope

    wrap(litellm, store=store)
    ran.clear()
    async with rollout("ll-loop", store=store) as r:
        with agent_scope("planner"):  # LiteLLM has no agent concept: name it yourself
            final = await _litellm_loop(llm_server, "capital of france and weather?", streaming)
    assert ran == ["lookup", "weather"] and final == "echo: sunny"
    assert_three_turn_loop(store.calls(r.id), agent="planner", streamed=streaming)


# ----------------------------------------------------------------- no cross-over

async def test_concurrent_rollouts_of_different_frameworks_do_not_mix(llm_server: LLMTestServer,
                                                                      store: TraceStore) -> None:
    pytest.importorskip("langchain")
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("agents")
    from agents import Runner

    lc = _langchain_agent(llm_server, store, "lc_agent")
    ag = _autogen_agent(llm_server, store, "ag_agent")
    sdk = _agents_sdk_agent(llm_server, store, "sdk_agent")
    ids: dict[str, str] = {}

    async def run_lc() -> None:
        async with rollout("mix-lc", store=store) as r:
            ids["lc_agent"] = r.id
            await lc.ainvoke({"messages": [{"role": "user", "content": "lc question"}]})

    async def run_ag() -> None:
        async with rollout("mix-ag", store=store) as r:
            ids["ag_agent"] = r.id
            await ag.run(task="ag question")

    async def run_sdk() -> None:
        async with rollout("mix-sdk", store=store) as r:
            ids["sdk_agent"] = r.id
            await Runner.run(sdk, "sdk question")

    for _ in range(2):
        await asyncio.gather(run_lc(), run_ag(), run_sdk())
        for agent, rid in ids.items():
            calls = store.calls(rid)
            assert len(calls) == 3 and {c.agent_name for c in calls} == {agent}
            question = agent.split("_")[0]
            assert all(question in json.dumps(c.request["messages"][:2]) for c in calls)
    assert store.count("llm_calls") == 18
