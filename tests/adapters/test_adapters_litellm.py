"""LiteLLM adapter: wrap(litellm) / wrap(router), hosted_vllm/ (LiteLLM's own httpx handlers) and openai/."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
litellm = pytest.importorskip("litellm")

from lightning_middleware import TraceStore, agent_scope, rollout, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer, render_chat, tokenize  # noqa: E402

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "math",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]


@pytest.fixture
def wrapped(store: TraceStore) -> TraceStore:
    assert wrap(litellm, store=store) is litellm
    return store


def test_hosted_vllm_completion_and_stream(llm_server: LLMTestServer, wrapped: TraceStore) -> None:
    store = wrapped
    kw = dict(model="hosted_vllm/m", api_base=llm_server.base_url, messages=MSGS)
    with rollout("ll-vllm", store=store) as r:
        out = litellm.completion(**kw)
        text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True))
    assert out.choices[0].message.content == text == "echo: what is 2+2?"
    plain, streamed = store.calls(r.id)
    assert plain.prompt_token_ids == tuple(tokenize(render_chat(MSGS))) == streamed.prompt_token_ids
    assert plain.completion_token_ids == streamed.completion_token_ids == tuple(tokenize(text))
    assert plain.is_training and streamed.is_training and streamed.stream and not plain.stream
    assert plain.logprobs is not None


async def test_acompletion_stream_and_tool_loop(llm_server: LLMTestServer, wrapped: TraceStore) -> None:
    store = wrapped
    kw = dict(model="hosted_vllm/m", api_base=llm_server.base_url)
    async with rollout("ll-async", store=store) as r:
        with agent_scope("planner"):
            first = await litellm.acompletion(**kw, messages=MSGS, tools=TOOLS)
        tc = first.choices[0].message.tool_calls[0]
        history = MSGS + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": tc.id, "content": "4"}]
        stream = await litellm.acompletion(**kw, messages=history, tools=TOOLS, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert tc.function.name == "calc" and text == "echo: 4"
    a, b = store.calls(r.id)
    assert a.finish_reason == "tool_calls" and b.finish_reason == "stop" and b.stream
    assert b.prompt_token_ids[: len(a.prompt_token_ids)] == a.prompt_token_ids
    assert a.is_training and b.is_training and a.agent_name == "planner" and b.agent_name is None


async def test_openai_provider(llm_server: LLMTestServer, wrapped: TraceStore) -> None:
    store = wrapped
    kw = dict(model="openai/m", api_base=llm_server.base_url, api_key="sk-test", messages=MSGS)
    async with rollout("ll-openai", store=store) as r:
        litellm.completion(**kw)
        await litellm.acompletion(**kw)
    calls = store.calls(r.id)
    assert len(calls) == 2 and all(c.is_training for c in calls)


async def test_router(llm_server: LLMTestServer, store: TraceStore) -> None:
    router = litellm.Router(model_list=[
        {"model_name": "policy", "litellm_params": {"model": "hosted_vllm/m", "api_base": llm_server.base_url}},
        {"model_name": "oai", "litellm_params": {"model": "openai/m", "api_base": llm_server.base_url,
                                                 "api_key": "sk-test"}},
    ])
    assert wrap(router, store=store) is router
    async with rollout("ll-router", store=store) as r:
        await router.acompletion(model="policy", messages=MSGS)
        router.completion(model="policy", messages=MSGS)
        await router.acompletion(model="oai", messages=MSGS)
    calls = store.calls(r.id)
    assert len(calls) == 3 and all(c.is_training for c in calls)


def test_clients_created_later_keep_recording(llm_server: LLMTestServer, wrapped: TraceStore) -> None:
    store = wrapped
    from litellm.llms.custom_httpx.http_handler import HTTPHandler

    kw = dict(model="hosted_vllm/m", api_base=llm_server.base_url, messages=MSGS)
    with rollout("ll-later", store=store) as r:
        litellm.completion(**kw)
        # the client cache expires (TTL) or is flushed: LiteLLM builds new clients, which record too
        for value in list(litellm.in_memory_llm_clients_cache.cache_dict.values()):
            if isinstance(value, HTTPHandler):
                value.client.close()  # a closed client is re-created by the handler
        litellm.completion(**kw)
        litellm.in_memory_llm_clients_cache.flush_cache()
        litellm.completion(**kw)
        litellm.completion(**kw, ssl_verify=False)  # new cache key -> new client
    assert len(store.calls(r.id)) == 4


def test_unknown_litellm_objects_are_refused() -> None:
    from litellm.caching.caching import Cache

    with pytest.raises(TypeError, match="does not know how to record"):
        wrap(Cache(type="local"))
