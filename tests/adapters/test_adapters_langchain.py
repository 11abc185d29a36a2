"""LangChain adapter: wrap(ChatOpenAI) against the deterministic server, real LangChain code paths."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading

import pytest

pytest.importorskip("langchain_openai")

from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from lightning_middleware import TraceStore, agent_scope, propagate, rollout, rollout_headers, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer, render_chat, tokenize  # noqa: E402

MSGS = [SystemMessage("be brief"), HumanMessage("what is 2+2?")]


_n = itertools.count()


def _model(server: LLMTestServer, store: TraceStore, **kw) -> ChatOpenAI:
    # langchain-openai caches its async HTTP client per (base_url, timeout): a distinct timeout gives
    # each test its own, since a cached async client can't outlive the test's event loop.
    kw.setdefault("timeout", 60 + next(_n) / 1000)
    return wrap(ChatOpenAI(model="m", base_url=server.base_url, api_key="sk-test", **kw), store=store)


@tool
def calc(query: str) -> str:
    """Evaluate a math question."""
    return "4"


def test_invoke_records_exact_tokens(llm_server: LLMTestServer, store: TraceStore) -> None:
    model = _model(llm_server, store)
    with rollout("lc-invoke", store=store) as r:
        out = model.invoke(MSGS)
    assert out.content == "echo: what is 2+2?"
    [call] = store.calls(r.id)
    expected_prompt = render_chat([{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "what is 2+2?"}])
    assert call.prompt_token_ids == tuple(tokenize(expected_prompt))
    assert call.completion_token_ids == tuple(tokenize("echo: what is 2+2?"))
    assert call.is_training and call.logprobs is not None and call.agent_name is None


async def test_ainvoke_astream_and_gather(llm_server: LLMTestServer, store: TraceStore) -> None:
    model = _model(llm_server, store)
    async with rollout("lc-async", store=store) as r:
        await model.ainvoke(MSGS)
        text = "".join([c.content async for c in model.astream(MSGS)])
        await asyncio.gather(*[model.ainvoke(f"q{i}") for i in range(4)])
    assert text == "echo: what is 2+2?"
    calls = store.calls(r.id)
    assert sorted(c.call_index for c in calls) == list(range(6))
    streamed = [c for c in calls if c.stream]
    assert len(streamed) == 1 and streamed[0].completion_token_ids == tuple(tokenize(text))
    assert all(c.is_training for c in calls)


def test_stream_and_batch_in_thread_pool(llm_server: LLMTestServer, store: TraceStore) -> None:
    model = _model(llm_server, store)
    with rollout("lc-batch", store=store) as r:
        text = "".join(c.content for c in model.stream(MSGS))
        outs = model.batch([f"item {i}" for i in range(5)], config={"max_concurrency": 5})
    assert text == "echo: what is 2+2?" and [o.content for o in outs] == [f"echo: item {i}" for i in range(5)]
    calls = store.calls(r.id)  # batch runs in LangChain's thread pool: the rollout context survives
    assert len(calls) == 6 and sorted(c.call_index for c in calls) == list(range(6))
    assert all(c.is_training for c in calls)


def test_bind_tools_and_structured_output(llm_server: LLMTestServer, store: TraceStore) -> None:
    class Query(BaseModel):
        query: str

    model = _model(llm_server, store)
    with rollout("lc-tools", store=store) as r:
        ai = model.bind_tools([calc]).invoke("what is 2+2?")
        fc = model.with_structured_output(Query, method="function_calling").invoke("what is 2+2?")
        with pytest.raises(ValueError):  # the test model does not write JSON (pydantic ValidationError)
            model.with_structured_output(Query, method="json_schema").invoke("hi")
    assert ai.tool_calls[0]["name"] == "calc" and ai.tool_calls[0]["args"] == {"query": "what is 2+2?"}
    assert fc == Query(query="what is 2+2?")
    a, b, c = store.calls(r.id)
    assert a.finish_reason == "tool_calls" and a.request["tools"][0]["function"]["name"] == "calc"
    assert b.request["tool_choice"]["function"]["name"] == "Query" and b.is_training
    assert c.request["response_format"]["type"] == "json_schema" and c.is_training  # recorded although parsing failed


def test_create_agent_tool_loop_with_agent_name(llm_server: LLMTestServer, store: TraceStore) -> None:
    from langchain.agents import create_agent

    ran: list[str] = []

    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        ran.append(query)
        return "forty-two"

    model = _model(llm_server, store)
    agent = create_agent(model, tools=[lookup], name="researcher")
    with rollout("lc-agent", store=store) as r:
        result = agent.invoke({"messages": [{"role": "user", "content": "meaning of life?"}]})
    assert ran == ["meaning of life?"]
    assert result["messages"][-1].content == "echo: forty-two"
    first, second = store.calls(r.id)
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    # the second prompt extends the first prompt + completion: one trainable multi-turn row
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert {first.agent_name, second.agent_name} == {"researcher"}


async def test_two_named_agents_and_scope(llm_server: LLMTestServer, store: TraceStore) -> None:
    from langchain.agents import create_agent

    model = _model(llm_server, store)
    writer = create_agent(model, tools=[calc], name="writer")
    critic = create_agent(model, tools=[], name="critic")
    async with rollout("lc-multi", store=store) as r:
        await writer.ainvoke({"messages": [{"role": "user", "content": "draft"}]})
        await critic.ainvoke({"messages": [{"role": "user", "content": "review"}]})
        await model.with_config(run_name="summariser").ainvoke("sum up")
        await model.ainvoke("tagged", config={"tags": ["agent:tagger"]})
        with agent_scope("outer"):
            await model.ainvoke("plain")  # no LangChain name: the user's agent_scope applies
    names = [c.agent_name for c in store.calls(r.id)]
    assert names == ["writer", "writer", "critic", "summariser", "tagger", "outer"]


def test_context_in_threads_and_header_fallback(llm_server: LLMTestServer, store: TraceStore) -> None:
    model = _model(llm_server, store, include_response_headers=True)
    seen: dict = {}
    with rollout("lc-threads", store=store) as r:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(propagate(lambda i: model.invoke(f"t{i}")), range(3)))
        headers = rollout_headers()

        def outside() -> None:  # a thread started without the context: only the header attaches it
            msg = model.invoke("from outside", extra_headers=headers)
            seen["headers"] = msg.response_metadata["headers"]["x-test-received-headers"]

        t = threading.Thread(target=outside)
        t.start()
        t.join()
    assert "x-rollout-id" not in seen["headers"].split(",")
    assert len(store.calls(r.id)) == 4


def test_shared_client_cache_keeps_recording(llm_server: LLMTestServer, store: TraceStore) -> None:
    model = _model(llm_server, store)
    # langchain-openai caches HTTP clients per base URL: copies and later models share the wrapped one
    later = ChatOpenAI(model="m", base_url=llm_server.base_url, api_key="sk-test", timeout=model.request_timeout)
    copied = model.model_copy()
    assert later.root_client._client is model.root_client._client
    assert wrap(model) is model  # wrapping twice is harmless
    with rollout("lc-cache", store=store) as r:
        later.invoke("a")
        copied.invoke("b")
        model.invoke("c")
    assert len(store.calls(r.id)) == 3


def test_wrap_accepts_bindings_and_rejects_other_runnables(llm_server: LLMTestServer, store: TraceStore) -> None:
    from langchain_core.runnables import RunnableLambda

    bound = ChatOpenAI(model="m", base_url=llm_server.base_url + "/", api_key="k", timeout=7).bind_tools([calc])
    assert wrap(bound, store=store) is bound
    with rollout("lc-bound", store=store) as r:
        bound.invoke("x")
    assert len(store.calls(r.id)) == 1
    with pytest.raises(TypeError, match="does not know how to record"):
        wrap(RunnableLambda(lambda x: x))


async def test_langgraph_nodes_are_agents_and_route_to_their_policies(llm_server: LLMTestServer,
                                                                      store: TraceStore) -> None:
    """A graph's nodes name its calls (no name given in the code); with `policies=` each node's
    calls go to its policy's served model name whatever model the code wrote."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    model = wrap(ChatOpenAI(model="m", base_url=llm_server.base_url, api_key="sk-test", timeout=60 + next(_n) / 1000),
                 store=store, policies={"coder": "coder-lora"}, default_policy="base")

    class State(TypedDict):
        text: str

    async def coder(state: State) -> State:
        return {"text": (await model.ainvoke(state["text"])).content}

    async def reviewer(state: State) -> State:
        return {"text": (await model.ainvoke(f"review: {state['text']}")).content}

    graph = StateGraph(State)
    graph.add_node("coder", coder)
    graph.add_node("reviewer", reviewer)
    graph.add_edge(START, "coder")
    graph.add_edge("coder", "reviewer")
    graph.add_edge("reviewer", END)
    async with rollout("lg-team", store=store) as r:
        await graph.compile().ainvoke({"text": "write"})
    calls = store.calls(r.id)
    assert [(c.agent_name, c.model) for c in calls] == [("coder", "coder-lora"), ("reviewer", "base")]
