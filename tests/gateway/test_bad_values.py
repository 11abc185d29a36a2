"""Values a client may send that a database refuses, on SQLite and PostgreSQL: each is either a
400 before anything is written, or (where the call itself is fine) recorded with the value made
to fit. Before, PostgreSQL refused such a row: a call was silently not recorded, or a request
got a 503 ("the store is unavailable") for what was the client's bad input.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from lightning_middleware import TraceStore
from lightning_middleware.gateway import Gateway
from lightning_middleware.testing import LLMTestServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "what is 2+2?"}], "max_tokens": 8}


@pytest.fixture
def gw(llm_server: LLMTestServer, store: TraceStore) -> Iterator[Gateway]:
    with Gateway([llm_server.base_url], store, health_interval_s=0, policy_version=1) as g:
        yield g


def new_rollout(gw: Gateway) -> str:
    r = httpx.post(gw.url + "/rollouts", json={"task_id": "t"}, timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


def test_absurd_but_valid_calls_are_recorded_made_to_fit(gw: Gateway, store: TraceStore) -> None:
    rid = new_rollout(gw)
    base = gw.rollout_base_url(rid) + "/chat/completions"
    sent = [
        ({**CHAT, "model": "m" * 300}, {}),  # PostgreSQL: VARCHAR(255)
        ({**CHAT, "model": "a\u0000b"}, {}),  # PostgreSQL: no NUL in text
        (CHAT, {"x-agent-name": "agent-" + "x" * 300}),
        (CHAT, {"x-stainless-retry-count": "9" * 30}),  # the attempt column is a 32-bit integer
        (CHAT, {"x-stainless-retry-count": "-5"}),
    ]
    for seed, (body, headers) in enumerate(sent):  # distinct bodies: a retry header would replay an equal one
        r = httpx.post(base, json={**body, "seed": seed}, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    assert httpx.post(gw.url + f"/rollouts/{rid}/finish", json={}, timeout=30).status_code == 200
    calls = sorted(store.calls(rid), key=lambda c: c.call_index)
    assert len(calls) == len(sent)  # none was lost
    assert [len(c.model or "") for c in calls[:2]] == [255, 3] and calls[1].model == "a\ufffdb"
    assert calls[2].agent_name is not None and len(calls[2].agent_name) == 255
    assert [c.attempt for c in calls[3:]] == [2**31 - 1, 1]
    assert all(c.is_training for c in calls)


def test_text_a_database_refuses_is_a_400_not_a_503(gw: Gateway, store: TraceStore) -> None:
    rid = new_rollout(gw)
    refused(httpx.post(gw.url + "/rollouts", json={"task_id": "t\u0000"}, timeout=30), "bad_task_id")
    refused(httpx.post(gw.url + f"/rollouts/{rid}/reward", json={"value": 1, "name": "n" * 256},
                       timeout=30), "bad_reward")
    refused(httpx.post(gw.url + f"/rollouts/{rid}/reward", json={"value": 1, "name": "a\u0000"},
                       timeout=30), "bad_reward")
    refused(httpx.post(gw.url + f"/rollouts/{rid}/reward", json={"value": 1, "name": 5}, timeout=30), "bad_reward")
    refused(httpx.get(gw.url + "/rollouts/a%00b", timeout=30), "bad_rollout_id")
    refused(httpx.get(gw.url + "/rollouts/" + "a" * 65, timeout=30), "bad_rollout_id")
    assert store.rewards(rid) == []
    # A failure's message is kept, whatever it holds.
    done = httpx.post(gw.url + f"/rollouts/{rid}/fail", json={"error": "tool said \u0000 and died"}, timeout=30)
    assert done.status_code == 200, done.text
    assert store.get_rollout(rid).error == "tool said \ufffd and died"


def test_admin_numbers_out_of_range_are_a_400(gw: Gateway, store: TraceStore) -> None:
    for body in ({"policy_version": 2**40}, {"policy_version": -1}):
        r = httpx.post(gw.url + "/admin/resume", json=body, timeout=30)
        assert r.status_code == 400, r.text
    for body in ({"timeout": 1e300}, {"timeout": -1}, {"timeout": "soon"}):
        r = httpx.post(gw.url + "/admin/pause", json=body, timeout=30)
        assert r.status_code == 400, r.text
    assert gw.state()["paused"] is False and gw.policy_version == 1
