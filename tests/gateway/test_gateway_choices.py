"""Requests with n > 1 through the gateway (a real uvicorn server, the test LLM server upstream):
the caller gets exactly what the engine sent, and every choice is recorded with its token IDs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from lightning_middleware import TraceStore
from lightning_middleware.gateway import Gateway
from lightning_middleware.records import LLMCall
from lightning_middleware.testing import LLMTestServer, render_chat, tokenize

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]


@pytest.fixture
def gw(llm_server: LLMTestServer, store: TraceStore) -> Iterator[Gateway]:
    with Gateway([llm_server.base_url], store, health_interval_s=0.5, policy_version=1) as g:
        yield g


def _rollout(gw: Gateway) -> str:
    rid = "r-" + uuid.uuid4().hex[:12]
    assert httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t"}, timeout=30).status_code == 201
    return rid


def _finish(gw: Gateway, rid: str) -> None:
    assert httpx.post(gw.url + f"/rollouts/{rid}/finish", json={}, timeout=30).status_code == 200


def _events(raw: bytes) -> list[dict]:
    """The JSON events of an SSE body, without `created` (a clock reading)."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            event.pop("created", None)
            out.append(event)
    return out


def _sent_choices(events: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """Per choice index: the token IDs and logprobs the engine streamed."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for event in events:
        for ch in event.get("choices") or []:
            ids, lps = out.setdefault(ch["index"], ([], []))
            ids += ch.get("token_ids") or []
            lps += [c["logprob"] for c in (ch.get("logprobs") or {}).get("content") or []]
    return out


def _assert_recorded(call: LLMCall, sent: dict[int, tuple[list[int], list[float]]]) -> None:
    assert call.is_training and not call.partial and call.policy_version == 1
    assert call.prompt_token_ids == tuple(tokenize(render_chat(MSGS)))
    assert [c.index for c in call.choices] == sorted(sent) == [0, 1, 2]
    for choice in call.choices:
        ids, lps = sent[choice.index]
        assert ids and choice.completion_token_ids == tuple(ids)
        assert choice.logprobs == pytest.approx(lps, abs=1e-6)


def test_n3_non_stream(gw: Gateway, store: TraceStore, llm_server: LLMTestServer) -> None:
    rid = _rollout(gw)
    body = {"model": "m", "messages": MSGS, "n": 3}
    via = httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json=body, timeout=30)
    assert via.status_code == 200
    # The engine's answer to the request the gateway sent (the caller's plus the injected fields).
    direct = httpx.post(llm_server.base_url + "/chat/completions",
                        json={**body, "return_token_ids": True, "logprobs": True}, timeout=30).json()
    got = via.json()
    assert {k: v for k, v in got.items() if k != "created"} == {k: v for k, v in direct.items() if k != "created"}
    _finish(gw, rid)
    [call] = store.calls(rid)
    sent = {c["index"]: (c["token_ids"], [t["logprob"] for t in c["logprobs"]["content"]]) for c in got["choices"]}
    _assert_recorded(call, sent)
    assert [c["message"]["content"] for c in call.response["choices"]] == [
        "echo: what is 2+2?", "echo 1: what is 2+2?", "echo 2: what is 2+2?"]


def test_n3_stream(gw: Gateway, store: TraceStore, llm_server: LLMTestServer) -> None:
    rid = _rollout(gw)
    body = {"model": "m", "messages": MSGS, "n": 3, "stream": True}
    via = httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json=body, timeout=30)
    direct = httpx.post(llm_server.base_url + "/chat/completions",
                        json={**body, "return_token_ids": True, "logprobs": True}, timeout=30)
    assert via.status_code == 200 and "text/event-stream" in via.headers["content-type"]
    assert _events(via.content) == _events(direct.content) and via.content.endswith(b"data: [DONE]\n\n")
    _finish(gw, rid)
    [call] = store.calls(rid)
    assert call.stream
    _assert_recorded(call, _sent_choices(_events(via.content)))
