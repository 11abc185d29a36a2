"""The gateway with a reward configuration: rollouts scored as they finish, per-step rewards
and late rewards over HTTP; on SQLite and PostgreSQL."""

from __future__ import annotations

import httpx
import openai
import pytest

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.gateway import Gateway
from lightning_middleware.records import TrainStep
from lightning_middleware.testing import LLMTestServer

TOOLS = [{"type": "function", "function": {"name": "run_python", "parameters": {"type": "object"}}}]
CONFIG = {"rules": {"task_complete": 5.0, "tool_call_valid": 1.0, "step_reward_sum": 1.0},
          "guards": {"repeated_tool_calls": {"weight": -1.0, "max_repeats": 1}}}


def gateway_turns(base_url: str, token: str = "unused") -> None:
    client = openai.OpenAI(base_url=base_url, api_key=token)  # the gateway's token, when it has one
    messages = [{"role": "user", "content": "add 2 and 2"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "4"}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)


def test_the_gateway_scores_rollouts_as_they_finish(llm_server: LLMTestServer, store: TraceStore) -> None:
    cfg = RewardConfig.from_dict(CONFIG)
    with Gateway([llm_server.base_url], store, rewards=cfg, health_interval_s=0.5) as gw:
        ro = httpx.post(gw.url + "/rollouts", json={"id": "g-1", "task_id": "t"}, timeout=30).json()
        gateway_turns(ro["base_url"])
        step = httpx.post(gw.url + "/rollouts/g-1/reward", json={"value": 0.5, "call_index": 0}, timeout=30).json()
        assert step["call_index"] == 0 and step["final"] is False and step["late"] is False
        own = httpx.post(gw.url + "/rollouts/g-1/reward", json={"value": 1.0}, timeout=30).json()
        assert (own["name"], own["final"]) == ("agent", False)  # an input of the components
        done = httpx.post(gw.url + "/rollouts/g-1/finish", json={}, timeout=30).json()
        assert done["status"] == "succeeded" and done["final_reward"] == pytest.approx(5.0 + 1.0 + 0.5)
        got = {r.name: r.value for r in store.rewards("g-1") if r.config_hash == cfg.hash}
        assert got == {"task_complete": 1.0, "tool_call_valid": 1.0, "step_reward_sum": 0.5,
                       "repeated_tool_calls": 0.0, "final": 6.5}

        # A late reward is kept and combined again, until a trainer takes the rollout.
        late = httpx.post(gw.url + "/rollouts/g-1/reward", json={"value": 0.0}, timeout=30).json()
        assert late["late"] is True and late["applied"] is True
        assert store.get_rollout("g-1").final_reward == pytest.approx(1.5)
        store.claim_rollouts(["g-1"], "trainer0")
        store.commit_train_step(TrainStep(step=1, rollout_ids=("g-1",), trainer_id="trainer0"))
        again = httpx.post(gw.url + "/rollouts/g-1/reward", json={"value": 1.0}, timeout=30).json()
        assert again["late"] is True and again["applied"] is False
        assert store.get_rollout("g-1").final_reward == pytest.approx(1.5)
        assert [r.value for r in store.rewards("g-1") if r.name == "agent"] == [1.0, 0.0, 1.0]


def test_agent_reward_false_refuses_a_rollouts_own_reward(llm_server: LLMTestServer, store: TraceStore) -> None:
    """The benchmark scores the rollout: a reward it sends itself is a 403, nothing is stored, the
    store has an event, and the configured components still score it at the finish."""
    scored = {"rules": {"tool_call_valid": 1.0, "succeeded": 2.0}}
    cfg = RewardConfig.from_dict({**scored, "agent_reward": False})
    assert cfg.hash == RewardConfig.from_dict(scored).hash  # who may report is not part of the scoring
    with Gateway([llm_server.base_url], store, rewards=cfg, health_interval_s=0.5) as gw:
        ro = httpx.post(gw.url + "/rollouts", json={"id": "g-own", "task_id": "t"}, timeout=30).json()
        gateway_turns(ro["base_url"])
        own = httpx.post(gw.url + "/rollouts/g-own/reward", json={"value": 100.0}, timeout=30)
        assert own.status_code == 403 and own.json()["error"]["code"] == "reward_refused"
        keyed = httpx.post(gw.url + "/rollouts/g-own/reward", json={"value": 100.0},
                           headers={"idempotency-key": "k1"}, timeout=30)
        assert keyed.status_code == 403
        finish_with = httpx.post(gw.url + "/rollouts/g-own/finish", json={"reward": 100.0}, timeout=30)
        assert finish_with.status_code == 403
        done = httpx.post(gw.url + "/rollouts/g-own/finish", json={}, timeout=30).json()
        assert done["status"] == "succeeded" and done["final_reward"] == pytest.approx(1.0 + 2.0)
    assert not [r for r in store.rewards("g-own") if r.name == "agent"]
    events = store.events(kind="reward_refused")
    assert len(events) == 3 and {e.data["rollout_id"] for e in events} == {"g-own"}


def test_agent_reward_must_be_a_boolean_and_agree_with_the_rules() -> None:
    with pytest.raises(ValueError, match="agent_reward must be true or false"):
        RewardConfig.from_dict({**CONFIG, "agent_reward": "no"})
    with pytest.raises(ValueError, match=r"which \['task_complete', 'step_reward_sum'\] read"):
        RewardConfig.from_dict({**CONFIG, "agent_reward": False})


def test_a_bad_reward_configuration_stops_the_gateway_at_start(llm_server: LLMTestServer, tmp_path) -> None:
    bad = tmp_path / "rewards.toml"
    bad.write_text('[rules]\nno_such = 1.0\n')
    with pytest.raises(ValueError, match="no built-in rule 'no_such'"):
        Gateway([llm_server.base_url], f"sqlite:///{tmp_path / 'x.db'}", rewards=str(bad))
