"""Separate policies per agent on the capture side: wrap(policies=...) and the gateway's --policy
send each agent's calls under its policy's served model name whatever the code wrote, record them
so, and rows never mix two policies."""

from __future__ import annotations

import httpx
import httpx2
import openai

from lightning_middleware import TraceStore, agent_scope, rollout, wrap
from lightning_middleware.rows import build_rows
from lightning_middleware.testing import TEST_BASE_URL, llm_http_client

POLICIES = {"coder": "coder-lora", "reviewer": "reviewer-lora"}


def _client(store: TraceStore, **kw: object) -> openai.OpenAI:
    return wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="x", http_client=llm_http_client(httpx2)),
                store=store, **kw)


def _turn(client: openai.OpenAI, agent: str | None, text: str) -> str:
    msgs = [{"role": "user", "content": text}]
    if agent is None:
        out = client.chat.completions.create(model="whatever-the-code-says", messages=msgs, max_tokens=8)
    else:
        with agent_scope(agent):
            out = client.chat.completions.create(model="whatever-the-code-says", messages=msgs, max_tokens=8)
    return out.model  # the test server answers with the model it was asked for


def test_each_agent_is_served_and_recorded_under_its_policy(store: TraceStore) -> None:
    client = _client(store, policies=POLICIES)
    with rollout("team", store=store) as r:
        seen = {a: _turn(client, a, f"{a} speaks") for a in ("coder", "reviewer", "coder")}
        unmapped = _turn(client, "planner", "planner speaks")
        anonymous = _turn(client, None, "nobody speaks")
    assert seen == {"coder": "coder-lora", "reviewer": "reviewer-lora"}
    assert unmapped == anonymous == "whatever-the-code-says"  # no default policy: left as written
    calls = store.calls(r.id)
    assert [c.model for c in calls] == ["coder-lora", "reviewer-lora", "coder-lora", "whatever-the-code-says",
                                        "whatever-the-code-says"]
    assert all(c.request["model"] == c.model for c in calls)  # the stored request is the one sent
    rows, _ = build_rows(calls, rollout_id=r.id)
    assert {(row.agent, row.policy) for row in rows} == {("coder", "coder-lora"), ("reviewer", "reviewer-lora"),
                                                         ("planner", "whatever-the-code-says"),
                                                         (None, "whatever-the-code-says")}


def test_a_default_policy_takes_every_other_agent_and_wrapping_again_keeps_the_map(store: TraceStore) -> None:
    client = _client(store, policies=POLICIES, default_policy="base")
    _client_again = wrap(client, store=store)  # settings kept
    assert _client_again is client
    with rollout("team", store=store):
        assert _turn(client, "planner", "hi") == "base"
        assert _turn(client, None, "hi") == "base"
        assert _turn(client, "reviewer", "hi") == "reviewer-lora"


def test_routing_applies_to_calls_outside_rollouts_even_unrecorded(store: TraceStore) -> None:
    client = _client(store, policies=POLICIES, record_unattached=False)
    assert _turn(client, "coder", "hi") == "coder-lora"
    store.flush()
    assert store.calls(None) == []


def test_one_agent_under_two_models_starts_a_new_row(store: TraceStore) -> None:
    """The agent's mapping changed mid-rollout: its calls under the two models never share a row."""
    client = _client(store, policies={"coder": "v-a"})
    with rollout("switch", store=store) as r:
        _turn(client, "coder", "one")
        wrap(client, store=store, policies={"coder": "v-b"})
        _turn(client, "coder", "two")
    rows, stats = build_rows(store.calls(r.id), rollout_id=r.id)
    assert [row.policy for row in rows] == ["v-a", "v-b"] and stats.merges == 0


def test_the_gateway_routes_by_the_agent_header(store: TraceStore, llm_server) -> None:
    from lightning_middleware.gateway import Gateway

    with Gateway([llm_server.base_url], store, health_interval_s=0.5, policies=POLICIES, default_policy="base") as gw:
        for agent, expected in (("coder", "coder-lora"), ("reviewer", "reviewer-lora"), (None, "base")):
            headers = {"x-agent-name": agent} if agent else {}
            resp = httpx.post(gw.url + "/v1/chat/completions", headers=headers, timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert resp.status_code == 200 and resp.json()["model"] == expected, agent
