"""Per-agent rewards (multi-agent rollouts, issue 17): from the agent code, over the gateway's
HTTP API, in the store (own column, `agent_rewards`), in inspect, the analysis frame and export;
a per-agent reward never moves the rollout's final reward. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from lightning_middleware import RewardConfig, TraceStore, agent_scope, emit_reward, rollout
from lightning_middleware.analysis import load_rewards
from lightning_middleware.analysis.export import sft_records
from lightning_middleware.cli import main
from lightning_middleware.gateway import Gateway
from lightning_middleware.testing import LLMTestServer
from tests.rewards.helpers import client_for, tool_agent


def test_agent_rewards_from_the_agent_code(store: TraceStore) -> None:
    client = client_for(store)
    with rollout("review-1", store=store) as r:
        with agent_scope("coder"):
            tool_agent(client, "write it", "ok")
        with agent_scope("reviewer"):
            tool_agent(client, "review it", "ok")
        r.reward(0.25, agent="coder")
        r.reward(0.5, agent="coder")  # the latest final one counts
        emit_reward(0.9, agent="reviewer")
        emit_reward(0.1, agent="reviewer", final=False)  # not final: not the agent's reward
        r.reward(1.0)  # the rollout's own
    assert store.flush()
    assert store.agent_rewards([r.id, "no-such"]) == {r.id: {"coder": 0.5, "reviewer": 0.9}, "no-such": {}}
    assert store.get_rollout(r.id).final_reward == 1.0
    with pytest.raises(ValueError, match="agent must be an agent's name"):
        with rollout("t", store=store) as bad:
            bad.reward(1.0, agent="")
    # shown in the analysis frame and the export
    df = load_rewards(store)
    assert sorted(df[df.rollout_id == r.id].agent.dropna()) == ["coder", "coder", "reviewer", "reviewer"]
    by_agent = {rec["agent"]: rec["agent_reward"] for rec in sft_records(store) if rec["rollout_id"] == r.id}
    assert by_agent == {"coder": 0.5, "reviewer": 0.9}


def test_an_agent_reward_alone_leaves_final_reward_unset(store: TraceStore) -> None:
    with rollout("t", store=store) as r:
        emit_reward(1.0, agent="solo")
    assert store.flush()
    assert store.get_rollout(r.id).final_reward is None and store.agent_rewards([r.id]) == {r.id: {"solo": 1.0}}


def test_with_a_configuration_an_agent_reward_is_no_component(store: TraceStore) -> None:
    cfg = RewardConfig.from_dict({"rules": {"agent_reward": 2.0}})
    with rollout("t", store=store, rewards=cfg) as r:
        r.reward(0.5)
        r.reward(3.0, agent="reviewer")
    r.reward(4.0, agent="reviewer")  # late: stored, no recombination, the final reward stays
    assert store.flush()
    finals = [x for x in store.rewards(r.id) if x.name == "final"]
    assert [f.value for f in finals] == [1.0] and store.get_rollout(r.id).final_reward == 1.0
    assert store.agent_rewards([r.id]) == {r.id: {"reviewer": 4.0}}


def test_the_gateway_takes_an_agent_field(llm_server: LLMTestServer, store: TraceStore) -> None:
    with Gateway([llm_server.base_url], store, health_interval_s=0.5) as gw:
        httpx.post(gw.url + "/rollouts", json={"id": "g-a", "task_id": "t"}, timeout=30).raise_for_status()
        got = httpx.post(gw.url + "/rollouts/g-a/reward", json={"value": 0.7, "agent": "reviewer"}, timeout=30).json()
        assert got["agent"] == "reviewer" and got["final"] is True and got["applied"] is False
        for bad in ("", 7, "x" * 129):
            err = httpx.post(gw.url + "/rollouts/g-a/reward", json={"value": 1, "agent": bad}, timeout=30)
            assert err.status_code == 400 and err.json()["error"]["code"] == "bad_agent"
        done = httpx.post(gw.url + "/rollouts/g-a/finish", json={"reward": 0.2}, timeout=30).json()
    assert done["final_reward"] == 0.2 and store.agent_rewards(["g-a"]) == {"g-a": {"reviewer": 0.7}}


def test_inspect_shows_rewards_with_their_agent(store: TraceStore, capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    with rollout("t", store=store) as r:
        r.reward(0.5, agent="reviewer")
        r.reward(0.25, name="lint", final=False, call_index=0)
    assert store.flush()
    assert main(["inspect", "--store", store.url.render_as_string(hide_password=False), r.id]) == 0
    out = capsys.readouterr().out
    assert "- reward - = 0.5 final agent=reviewer" in out and "- reward lint = 0.25 call=0" in out
    assert json.loads(out[: out.index("\n}") + 2])["id"] == r.id
