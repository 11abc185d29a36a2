"""rollout() as context manager and decorator, rewards, outcomes, and the light core import."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx2
import openai
import pytest

from lightning_middleware import TraceStore, emit_reward, rollout, wrap
from lightning_middleware.testing import TEST_BASE_URL, llm_http_client


def test_decorator_sync_records_each_call_as_a_rollout(store: TraceStore) -> None:
    client = wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="x", http_client=llm_http_client(httpx2)), store=store)

    @rollout("deco", store=store, metadata={"v": 1})
    def agent(q: str) -> str:
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])
        emit_reward(len(q))
        return out.choices[0].message.content

    assert agent("ab") == "echo: ab" and agent("abc") == "echo: abc"
    rs = store.query_rollouts(task_id="deco")
    assert [r.final_reward for r in rs] == [2.0, 3.0] and all(r.metadata == {"v": 1} for r in rs)
    assert all(len(store.calls(r.id)) == 1 for r in rs)


async def test_decorator_async_and_failures(store: TraceStore) -> None:
    @rollout("adeco", store=store)
    async def boom() -> None:
        await asyncio.sleep(0)
        raise ValueError("tool exploded")

    with pytest.raises(ValueError):
        await boom()

    @rollout("slow", store=store)
    async def slow() -> None:
        await asyncio.wait_for(asyncio.sleep(10), 0.01)

    with pytest.raises(TimeoutError):
        await slow()
    [failed] = store.query_rollouts(task_id="adeco")
    assert failed.status == "failed" and failed.error == "ValueError: tool exploded" and failed.duration_s >= 0
    [timed_out] = store.query_rollouts(task_id="slow")
    assert timed_out.status == "timeout"


def test_nested_rollouts_restore_the_outer(store: TraceStore) -> None:
    with rollout("outer", store=store) as outer:
        with rollout("inner", store=store) as inner:
            emit_reward(2.0)
        emit_reward(1.0)
    assert store.get_rollout(inner.id).final_reward == 2.0
    assert store.get_rollout(outer.id).final_reward == 1.0


def test_reward_validation_and_non_final_rewards(store: TraceStore) -> None:
    with pytest.raises(RuntimeError, match="outside a rollout"):
        emit_reward(1.0)
    with rollout("rw", store=store) as r:
        with pytest.raises(ValueError, match="NaN"):
            r.reward(float("nan"))
        with pytest.raises(TypeError, match="number"):
            r.reward("high")  # type: ignore[arg-type]
        r.reward(0.3, name="format", final=False)
        r.reward(0.9)
    ro = store.get_rollout(r.id)
    assert ro.final_reward == 0.9
    assert [(x.name, x.final) for x in store.rewards(r.id)] == [("format", False), (None, True)]


def test_bad_rollout_arguments(store: TraceStore) -> None:
    with pytest.raises(ValueError, match="mode"):
        rollout("t", mode="training", store=store)
    with pytest.raises(ValueError, match="task_id"):
        rollout("", store=store)


def test_core_import_stays_light() -> None:
    heavy = ("torch", "transformers", "vllm", "verl", "langchain_core", "autogen_agentchat", "agents", "litellm",
             "openai", "httpx2", "pandas", "fastapi")
    code = ("import sys, lightning_middleware, adapters; "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
