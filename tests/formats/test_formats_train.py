"""The OpenAI Agents SDK as it comes (its default model over the Responses API, default model
settings) trains end to end: wrap() translates each turn into chat completions, the turns of a
run merge into one row, and the real trainer daemon takes a step on those rows.

The deterministic test server's token IDs are UTF-8 bytes, so a tiny random Qwen2 with a
260-token vocabulary trains on them (as in tests/trainer/test_daemon.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("agents")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled  # noqa: E402
from agents.models import _openai_shared  # noqa: E402

from lightning_middleware import TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402
from trainer_backend.daemon.config import GroupPolicy, TrainerConfig  # noqa: E402
from trainer_backend.daemon.trainer_daemon import TrainerDaemon  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

set_tracing_disabled(True)  # no trace export: no network

REWARDS = (1.0, 0.0, 1.0, 0.0)  # one group with a signal


@function_tool
def calc(query: str) -> str:
    """Evaluate a math question."""
    return "4"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    from tests.trainer.tiny_models import save_tiny_qwen2

    # byte-level: the test server's token IDs are UTF-8 bytes
    return save_tiny_qwen2(tmp_path / "tiny_bytes_model", vocab=260, hidden=32, layers=1, heads=2, kv_heads=1,
                           max_positions=2048)


@pytest.fixture
def default_client(llm_server: LLMTestServer, store: TraceStore) -> Iterator[openai.AsyncOpenAI]:
    """The SDK's default client, wrapped, with the Responses API as the default (other tests change it)."""
    saved = (_openai_shared.get_default_openai_client(), _openai_shared.get_use_responses_by_default())
    client = wrap(openai.AsyncOpenAI(base_url=llm_server.base_url, api_key="sk-test"), store=store)
    set_default_openai_client(client, use_for_tracing=False)
    _openai_shared.set_use_responses_by_default(True)
    try:
        yield client
    finally:
        _openai_shared.set_default_openai_client(saved[0])
        _openai_shared.set_use_responses_by_default(saved[1])


async def test_agents_sdk_default_responses_model_trains(default_client, store: TraceStore, model_dir: Path,
                                                         tmp_path: Path) -> None:
    agent = Agent(name="solver", instructions="be brief", tools=[calc])  # no model, no model settings
    for i, reward in enumerate(REWARDS):
        async with rollout("agents-default", store=store) as r:
            result = await Runner.run(agent, f"what is 2+2? (try {i})")
            r.reward(reward)
        assert result.final_output == "echo: 4"
        calls = store.calls(r.id)
        assert [c.source_format for c in calls] == ["responses", "responses"]
        assert all(c.is_training and c.endpoint == "chat.completions" for c in calls)
    store.flush()

    start, version = TrainerDaemon.resume_point(store, model_dir, "trainer-fmt")
    engine = TorchEngine(start, TorchEngineConfig(lr=1e-3, precision="fp32"), policy_version=version)
    config = TrainerConfig(checkpoint_dir=str(tmp_path / "ckpt"), trainer_id="trainer-fmt", poll_interval_s=0.05,
                           group=GroupPolicy(group_size=len(REWARDS), groups_per_step=1,
                                             min_group_size=len(REWARDS)))
    with TrainerDaemon(store, engine, config) as daemon:  # closed: its lease thread ends with the test
        [step] = daemon.run(max_steps=1)

    m = step.metrics
    assert step.step == 1 and step.policy_version == 1 and store.latest_policy_version() == 1
    assert m["n_rollouts"] == len(REWARDS) and m["n_groups"] == 1
    # Both turns of each run (tool call, then the answer after the tool's output) merged into one row.
    assert m["rows_merges"] == len(REWARDS) and m["rows_prefix_breaks"] == 0
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert len(store.query_rollouts(consumed=True)) == len(REWARDS)
