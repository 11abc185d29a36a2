"""A rollout's own agent -> policy map on the gateway (issue 17): `POST /rollouts` with `policies`
and `default_policy`; the rollout's calls are sent upstream under its map's served model names
(the test LLM server answers with the model it was asked for), recorded so, and routed the same
by a new gateway on the same store. Real uvicorn gateways, the real test LLM server, SQLite and
PostgreSQL."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from lightning_middleware import TraceStore
from lightning_middleware.gateway import Gateway, GatewayClient, GatewayClientError
from lightning_middleware.rows import build_rows
from lightning_middleware.testing import LLMTestServer

GATEWAY_WIDE = {"coder": "gw-coder", "tester": "gw-tester"}
MSGS = [{"role": "user", "content": "write it"}]


def _rid() -> str:
    return "pol-" + uuid.uuid4().hex[:10]


def _call(url: str, agent: str | None, *, rollout_header: str | None = None, stream: bool = False) -> str:
    """One call as an agent writes it (its own model name); the model the upstream was asked for."""
    headers = {"x-agent-name": agent} if agent else {}
    if rollout_header:
        headers["x-rollout-id"] = rollout_header
    client = openai.OpenAI(base_url=url, api_key="unused", default_headers=headers, max_retries=0)
    if not stream:
        return client.chat.completions.create(model="what-the-code-says", messages=MSGS, max_tokens=4).model
    chunks = list(client.chat.completions.create(model="what-the-code-says", messages=MSGS, max_tokens=4,
                                                 stream=True))
    return chunks[0].model


def test_two_rollouts_with_their_own_maps_through_one_gateway(llm_server: LLMTestServer, store: TraceStore) -> None:
    a, b = _rid(), _rid()
    with Gateway([llm_server.base_url], store, health_interval_s=0, policies=GATEWAY_WIDE,
                 default_policy="gw-base") as gw, GatewayClient(gw.url) as client:
        made_a = client.create_rollout("team", rollout_id=a, policies={"coder": "a-coder"}, default_policy="a-base")
        client.create_rollout("team", rollout_id=b, policies={"coder": "b-coder", "reviewer": "b-rev"})
        assert (made_a["policies"], made_a["default_policy"]) == ({"coder": "a-coder"}, "a-base")
        assert client.get_rollout(b)["policies"] == {"coder": "b-coder", "reviewer": "b-rev"}
        url_a = gw.rollout_base_url(a)
        seen_a = [_call(url_a, "coder"), _call(url_a, "tester"), _call(url_a, "reviewer"), _call(url_a, None),
                  _call(url_a, "coder", stream=True)]
        # Rollout b by the x-rollout-id header on the plain base URL: the same rollout, the same map.
        seen_b = [_call(gw.base_url, agent, rollout_header=b) for agent in ("coder", "reviewer", "tester", None)]
        outside = _call(gw.base_url, "coder")  # no rollout: the gateway-wide map only
        client.finish(a)
        client.finish(b)
    # Its own map, then the gateway-wide map, then its default, then the gateway's default.
    assert seen_a == ["a-coder", "gw-tester", "a-base", "a-base", "a-coder"]
    assert seen_b == ["b-coder", "b-rev", "gw-tester", "gw-base"]
    assert outside == "gw-coder"
    for rid, seen in ((a, seen_a), (b, seen_b)):
        calls = store.calls(rid)
        assert [c.model for c in calls] == seen
        assert all(c.request["model"] == c.model and c.is_training for c in calls)  # stored as sent
        rows, _ = build_rows(calls, rollout_id=rid)
        assert {(row.agent, row.policy) for row in rows} == {(c.agent_name, c.model) for c in calls}
    assert store.get_rollout(a).metadata["lightning_policies"] == {"policies": {"coder": "a-coder"},
                                                                   "default_policy": "a-base"}


@pytest.mark.parametrize(("body", "param"), [
    ({"policies": ["coder"]}, "policies"),
    ({"policies": "coder=a"}, "policies"),
    ({"policies": {"coder": 7}}, "policies"),
    ({"policies": {"coder": ""}}, "policies"),
    ({"policies": {"coder": "  "}}, "policies"),
    ({"policies": {"": "a"}}, "policies"),
    ({"policies": {"c" * 129: "a"}}, "policies"),
    ({"policies": {"coder": "m" * 256}}, "policies"),
    ({"policies": {"coder": "a\x00b"}}, "policies"),
    ({"policies": {f"agent{i}": "m" for i in range(257)}}, "policies"),
    ({"default_policy": 3}, "default_policy"),
    ({"default_policy": ""}, "default_policy"),
    ({"default_policy": ["base"]}, "default_policy"),
])
def test_a_bad_map_is_a_400_and_stores_nothing(llm_server: LLMTestServer, tmp_path, body: dict, param: str) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'bad.db'}")
    rid = _rid()
    with Gateway([llm_server.base_url], store, health_interval_s=0) as gw:
        resp = httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t", **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "bad_policies" and error["param"] == param and param in error["message"]
    assert store.get_rollout(rid) is None
    store.close()


def test_the_reserved_metadata_key_and_a_changed_map_are_refused(llm_server: LLMTestServer, tmp_path) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'keys.db'}")
    rid = _rid()
    with Gateway([llm_server.base_url], store, health_interval_s=0) as gw, GatewayClient(gw.url) as client:
        reserved = httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t",
                                                          "metadata": {"lightning_policies": {"x": "y"}}}, timeout=30)
        assert reserved.status_code == 400 and reserved.json()["error"]["code"] == "bad_metadata"
        assert store.get_rollout(rid) is None
        assert client.create_rollout("t", rollout_id=rid, policies={"coder": "c1"})["created"]
        again = client.create_rollout("t", rollout_id=rid, policies={"coder": "c1"})  # a resent create
        assert again["created"] is False and again["policies"] == {"coder": "c1"}
        with pytest.raises(GatewayClientError, match="409.*another policy map"):
            client.create_rollout("t", rollout_id=rid, policies={"coder": "c2"})
    assert store.get_rollout(rid).metadata == {"lightning_policies": {"policies": {"coder": "c1"},
                                                                      "default_policy": None}}
    store.close()


def test_a_restarted_gateway_routes_an_open_rollout_the_same(llm_server: LLMTestServer, store: TraceStore) -> None:
    rid = _rid()
    with Gateway([llm_server.base_url], store, health_interval_s=0) as gw, GatewayClient(gw.url) as client:
        client.create_rollout("team", rollout_id=rid, policies={"coder": "coder-lora"}, default_policy="base-lora")
        before = [_call(gw.rollout_base_url(rid), "coder"), _call(gw.rollout_base_url(rid), "planner")]
    # A new gateway app on the same store, with no map of its own, knows nothing of the rollout
    # but what the store holds.
    with Gateway([llm_server.base_url], store, health_interval_s=0) as gw2, GatewayClient(gw2.url) as client:
        after = [_call(gw2.rollout_base_url(rid), "coder"), _call(gw2.base_url, "planner", rollout_header=rid)]
        client.finish(rid)
    assert before == after == ["coder-lora", "base-lora"]
    calls = store.calls(rid)
    assert [(c.call_index, c.model) for c in calls] == [(0, "coder-lora"), (1, "base-lora"), (2, "coder-lora"),
                                                        (3, "base-lora")]


def test_a_translated_call_follows_its_rollouts_map(llm_server: LLMTestServer, tmp_path) -> None:
    """A Responses API call of the rollout is sent as chat completions under the map's model name."""
    store = TraceStore(f"sqlite:///{tmp_path / 'fmt.db'}")
    rid = _rid()
    with Gateway([llm_server.base_url], store, health_interval_s=0) as gw, GatewayClient(gw.url) as client:
        client.create_rollout("t", rollout_id=rid, policies={"coder": "coder-lora"})
        sdk = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="unused", max_retries=0,
                            default_headers={"x-agent-name": "coder"})
        assert sdk.responses.create(model="as-written", input="hi", max_output_tokens=8).output_text
        client.finish(rid)
    [call] = store.calls(rid)
    assert (call.model, call.request["model"], call.source_request["model"]) == ("coder-lora", "coder-lora",
                                                                                 "as-written")
    assert call.is_training
    store.close()
