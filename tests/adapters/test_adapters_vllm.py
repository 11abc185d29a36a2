"""Each framework, wrapped, against the real vLLM CPU server: two turns, exact token IDs recorded.

The tiny random model writes no tool calls, so the turns are plain chat: the
point here is that each framework's real HTTP path to a real engine records the
engine's own prompt token IDs (equal to vLLM's /tokenize of the same messages),
completion token IDs and logprobs, in order, in the right rollout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import openai
import pytest

from lightning_middleware import LLMCall, TraceStore, rollout, wrap

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTION = "hello there, how are you?"
SAMPLING = {"max_tokens": 6, "temperature": 1.0}


def _tokenize(server, messages: list[dict]) -> tuple[int, ...]:
    out = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages,
                                                     "add_generation_prompt": True}, timeout=60).json()
    return tuple(out["tokens"])


def _check(server, calls: list[LLMCall], first_reply: str) -> None:
    assert [c.call_index for c in calls] == [0, 1]
    assert all(c.is_training and c.completion_token_ids and c.logprobs for c in calls)
    assert all(len(c.logprobs) == len(c.completion_token_ids) for c in calls)
    first = [{"role": "user", "content": QUESTION}]
    assert calls[0].prompt_token_ids == _tokenize(server, first)
    second = first + [{"role": "assistant", "content": first_reply}, {"role": "user", "content": "and then?"}]
    assert calls[1].prompt_token_ids == _tokenize(server, second)


@pytest.fixture
def store(tmp_path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'vllm.db'}")
    yield s
    s.close()  # its writer threads end with the test


@pytest.fixture
def fresh_weights(vllm_server, tied_checkpoints) -> None:
    """Other tests swap weights into the shared server: make the served tokenizer's model consistent."""
    from trainer_backend.serving.publisher import WeightPublisher

    WeightPublisher(vllm_server.url).publish(tied_checkpoints.base, "adapters")


def test_langchain_on_vllm(vllm_server, fresh_weights, store) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    llm = wrap(ChatOpenAI(model="tiny", base_url=vllm_server.base_url, api_key="-", **SAMPLING), store=store)
    with rollout("lc-vllm", store=store) as r:
        reply = llm.invoke([HumanMessage(QUESTION)]).content
        llm.invoke([HumanMessage(QUESTION), AIMessage(reply), HumanMessage("and then?")])
    _check(vllm_server, store.calls(r.id), reply)


async def test_autogen_on_vllm(vllm_server, fresh_weights, store) -> None:
    pytest.importorskip("autogen_ext")
    from autogen_core.models import AssistantMessage, UserMessage
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    info = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
            "structured_output": False}
    client = wrap(OpenAIChatCompletionClient(model="tiny", base_url=vllm_server.base_url, api_key="-",
                                             model_info=info, **SAMPLING), store=store)
    async with rollout("ag-vllm", store=store) as r:
        reply = (await client.create([UserMessage(content=QUESTION, source="user")])).content
        await client.create([UserMessage(content=QUESTION, source="user"),
                             AssistantMessage(content=reply, source="assistant"),
                             UserMessage(content="and then?", source="user")])
    _check(vllm_server, store.calls(r.id), reply)


async def test_agents_sdk_on_vllm(vllm_server, fresh_weights, store) -> None:
    pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    model = wrap(OpenAIChatCompletionsModel(model="tiny", openai_client=openai.AsyncOpenAI(
        base_url=vllm_server.base_url, api_key="-")), store=store)
    agent = Agent(name="talker", model=model, model_settings=ModelSettings(max_tokens=6, temperature=1.0))
    async with rollout("sdk-vllm", store=store) as r:
        result = await Runner.run(agent, QUESTION)
        reply = result.final_output
        await Runner.run(agent, result.to_input_list() + [{"role": "user", "content": "and then?"}])
    calls = store.calls(r.id)
    assert {c.agent_name for c in calls} == {"talker"}
    _check(vllm_server, calls, reply)


async def test_litellm_on_vllm(vllm_server, fresh_weights, store) -> None:
    litellm = pytest.importorskip("litellm")

    wrap(litellm, store=store)
    kw = dict(model="hosted_vllm/tiny", api_base=vllm_server.base_url, **SAMPLING)
    async with rollout("ll-vllm", store=store) as r:
        reply = (await litellm.acompletion(messages=[{"role": "user", "content": QUESTION}], **kw)
                 ).choices[0].message.content
        await litellm.acompletion(messages=[{"role": "user", "content": QUESTION},
                                            {"role": "assistant", "content": reply},
                                            {"role": "user", "content": "and then?"}], **kw)
    _check(vllm_server, store.calls(r.id), reply)
