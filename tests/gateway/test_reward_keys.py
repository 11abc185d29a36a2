"""A retried reward POST stores its reward once (issue 20): the `Idempotency-Key` header on
`POST /rollouts/{id}/reward`, kept with the reward in the store, and `GatewayClient` sending one
key per logical reward on every retry. Real uvicorn gateways, the real test LLM server, SQLite
and PostgreSQL; the lost answer is a real HTTP exchange whose response is thrown away (by an
httpx transport, and by a TCP proxy that closes the client's socket instead of answering)."""

from __future__ import annotations

import concurrent.futures
import uuid

import httpx
import pytest

from lightning_middleware import TraceStore
from lightning_middleware.gateway import REPLAY_HEADER, Gateway, GatewayClient
from lightning_middleware.testing import LLMTestServer
from tests.gateway.drop_proxy import DropFirstAnswerProxy


def _rid() -> str:
    return "rw-" + uuid.uuid4().hex[:10]


def _open(gw: Gateway) -> str:
    rid = _rid()
    httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t"}, timeout=30).raise_for_status()
    return rid


def _reward(gw: Gateway, rid: str, body: dict, key: str | None) -> httpx.Response:
    headers = {"idempotency-key": key} if key else {}
    return httpx.post(gw.url + f"/rollouts/{rid}/reward", json=body, headers=headers, timeout=30)


class LoseFirstAnswer(httpx.HTTPTransport):
    """Sends every request for real; the first reward's answer is read off the socket and thrown
    away, and the client is told its read timed out (a response lost on the way back)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/reward") and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost on the way back", request=request)
        return response


@pytest.fixture
def gw(llm_server: LLMTestServer, store: TraceStore):
    with Gateway([llm_server.base_url], store, health_interval_s=0) as g:
        yield g


def test_a_retry_with_the_same_key_stores_one_reward(gw: Gateway, store: TraceStore) -> None:
    rid = _open(gw)
    first = _reward(gw, rid, {"value": 0.75}, "k-1")
    retries = [_reward(gw, rid, {"value": 0.75}, "k-1") for _ in range(3)]
    assert first.status_code == 200 and REPLAY_HEADER not in first.headers
    assert all(r.status_code == 200 and r.content == first.content and r.headers[REPLAY_HEADER] == "1"
               for r in retries)
    assert first.json()["applied"] is True
    stored = store.rewards_for([rid])[rid]
    assert [(r.value, r.metadata) for r in stored] == [(0.75, {"idempotency_key": "k-1"})]
    assert store.get_rollout(rid).final_reward == 0.75


def test_different_keys_and_no_key_store_every_reward(gw: Gateway, store: TraceStore) -> None:
    rid = _open(gw)
    for key in ("k-1", "k-2", None, None):
        assert _reward(gw, rid, {"value": 1.0, "name": "judge", "final": False}, key).status_code == 200
    assert len(store.rewards_for([rid])[rid]) == 4


def test_a_key_is_per_rollout_and_a_changed_body_is_a_409(gw: Gateway, store: TraceStore) -> None:
    a, b = _open(gw), _open(gw)
    assert _reward(gw, a, {"value": 1.0}, "same").status_code == 200
    assert _reward(gw, b, {"value": 1.0}, "same").status_code == 200  # another rollout: its own reward
    changed = _reward(gw, a, {"value": 0.0}, "same")
    assert changed.status_code == 409 and changed.json()["error"]["code"] == "idempotency_conflict"
    too_long = _reward(gw, a, {"value": 1.0}, "k" * 256)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "bad_idempotency_key"
    got = store.rewards_for([a, b])
    assert [r.value for r in got[a]] == [1.0] and [r.value for r in got[b]] == [1.0]


def test_retries_racing_the_first_request_store_one(gw: Gateway, store: TraceStore) -> None:
    rid = _open(gw)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _reward(gw, rid, {"value": 0.5, "agent": "coder"}, "burst"), range(8)))
    assert {a.status_code for a in answers} == {200} and len({a.content for a in answers}) == 1
    assert len(store.rewards_for([rid])[rid]) == 1


def test_a_restarted_gateway_still_stores_the_key_once(llm_server: LLMTestServer, store: TraceStore) -> None:
    with Gateway([llm_server.base_url], store, health_interval_s=0) as gw:
        rid = _open(gw)
        first = _reward(gw, rid, {"value": 1.0, "agent": "reviewer"}, "before-restart")
    with Gateway([llm_server.base_url], store, health_interval_s=0) as gw2:  # its memory holds no key
        retry = _reward(gw2, rid, {"value": 1.0, "agent": "reviewer"}, "before-restart")
        changed = _reward(gw2, rid, {"value": 0.0, "agent": "reviewer"}, "before-restart")
    assert retry.status_code == 200 and retry.headers[REPLAY_HEADER] == "1"
    assert {**first.json(), "applied": False} == retry.json()  # rebuilt from the store: this retry applied nothing
    assert changed.status_code == 409
    assert len(store.rewards_for([rid])[rid]) == 1


def test_the_client_retries_a_lost_answer_with_the_same_key(gw: Gateway, store: TraceStore) -> None:
    lossy = LoseFirstAnswer()
    with GatewayClient(gw.url, transport=lossy, backoff_s=0.01) as client:
        rid = client.create_rollout("t")["id"]
        answer = client.reward(rid, 1.0, agent="coder")
        client.reward(rid, 0.5, name="style", final=False)  # a second logical reward: a key of its own
        client.reward(rid, 0.1, call_index=0)  # a per-step reward: not final by the gateway's rule
        client.finish(rid)
    assert lossy.lost == 1 and answer["value"] == 1.0
    stored = store.rewards_for([rid])[rid]
    assert [(r.value, r.agent, r.final) for r in stored] == [(1.0, "coder", True), (0.5, None, False),
                                                             (0.1, None, False)]
    assert len({r.metadata["idempotency_key"] for r in stored}) == 3


def test_the_client_retries_through_a_proxy_that_drops_the_answer(gw: Gateway, store: TraceStore) -> None:
    """The same over a real TCP proxy: the gateway answered, the proxy closed the client's socket."""
    with DropFirstAnswerProxy(gw.port) as proxy, GatewayClient(proxy.url, backoff_s=0.01) as client:
        rid = client.create_rollout("t")["id"]
        assert client.reward(rid, 0.25, agent="reviewer")["value"] == 0.25
        client.finish(rid, reward=1.0)
    assert proxy.dropped == 1 and proxy.passed == 3  # create, the reward's retry, finish
    stored = store.rewards_for([rid])[rid]
    assert [(r.value, r.agent) for r in stored] == [(0.25, "reviewer"), (1.0, None)]


def test_without_a_key_a_lost_answer_is_stored_twice(gw: Gateway, store: TraceStore) -> None:
    """The defect the key fixes: a plain retry of a reward whose answer was lost."""
    rid = _open(gw)
    lossy = LoseFirstAnswer()
    with httpx.Client(transport=lossy) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(gw.url + f"/rollouts/{rid}/reward", json={"value": 1.0})
        http.post(gw.url + f"/rollouts/{rid}/reward", json={"value": 1.0}).raise_for_status()
    assert len(store.rewards_for([rid])[rid]) == 2
