"""The gateway on a real uvicorn server with real clients: the openai SDK, LangChain, curl.

Store-touching core tests run on SQLite and PostgreSQL (the `store` fixture);
routing, errors and security run on SQLite only.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import sqlalchemy as sa

from lightning_middleware import TraceStore
from lightning_middleware.capture import scrub_secrets
from lightning_middleware.gateway import Gateway, GatewayConfigError
from lightning_middleware.testing import LLMTestServer, free_port, process_cpu_seconds, render_chat, tokenize

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rid() -> str:
    return "r-" + uuid.uuid4().hex[:12]


def _create(gw: Gateway, rid: str | None = None, task: str = "task", **kw) -> dict:
    r = httpx.post(gw.url + "/rollouts", json={"id": rid or _rid(), "task_id": task, **kw},
                   headers=_auth(gw), timeout=30)
    assert r.status_code in (200, 201), r.text
    return r.json()


def _auth(gw: Gateway) -> dict[str, str]:
    return {"authorization": f"Bearer {gw.token}"} if gw.token else {}


def _finish(gw: Gateway, rid: str, **body) -> httpx.Response:
    return httpx.post(gw.url + f"/rollouts/{rid}/finish", json=body, headers=_auth(gw), timeout=30)


@pytest.fixture
def sqlite_store(tmp_path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'gw.db'}")
    yield s
    s.close()


@pytest.fixture
def gw(llm_server: LLMTestServer, store: TraceStore) -> Iterator[Gateway]:
    with Gateway([llm_server.base_url], store, health_interval_s=0.5, policy_version=1) as g:
        yield g


@pytest.fixture
def gw_lite(llm_server: LLMTestServer, sqlite_store: TraceStore) -> Iterator[Gateway]:
    with Gateway([llm_server.base_url], sqlite_store, health_interval_s=0.5, max_body_bytes=64 * 1024) as g:
        yield g


# --------------------------------------------------------------------------
# Rollouts and the OpenAI endpoints
# --------------------------------------------------------------------------

def test_openai_sdk_rollout_lifecycle(gw: Gateway, store: TraceStore, llm_server: LLMTestServer) -> None:
    rid = _rid()
    first = httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t-1", "input": {"q": 4}}, timeout=30)
    again = httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t-1"}, timeout=30)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["base_url"] == gw.rollout_base_url(rid) and again.json()["created"] is False

    client = openai.OpenAI(base_url=first.json()["base_url"], api_key="sk-test")
    raw = client.chat.completions.with_raw_response.create(model="m", messages=MSGS, max_tokens=50)
    out = raw.parse()
    assert out.choices[0].message.content == "echo: what is 2+2?"
    assert raw.headers["x-lightning-policy-version"] == "1"
    # The caller's response is what the engine answered to the same (injected) request.
    direct = httpx.post(llm_server.base_url + "/chat/completions", json={
        "model": "m", "messages": MSGS, "max_tokens": 50, "return_token_ids": True, "logprobs": True},
            timeout=30).json()
    via = json.loads(raw.http_response.content)
    assert {k: v for k, v in via.items() if k != "created"} == {k: v for k, v in direct.items() if k != "created"}

    assert httpx.post(gw.url + f"/rollouts/{rid}/reward", json={"value": 0.75}, timeout=30).status_code == 200
    done = _finish(gw, rid)
    assert done.status_code == 200 and done.json()["status"] == "succeeded"
    [call] = store.calls(rid)
    assert call.is_training and call.call_index == 0 and call.policy_version == 1
    assert call.prompt_token_ids == tuple(tokenize(render_chat(MSGS)))
    assert call.completion_token_ids == tuple(tokenize("echo: what is 2+2?"))
    assert call.logprobs is not None and len(call.logprobs) == len(call.completion_token_ids)
    assert "return_token_ids" not in call.request and call.request["messages"] == MSGS
    ro = store.get_rollout(rid)
    assert ro.status == "succeeded" and ro.final_reward == 0.75 and ro.input == {"q": 4} and ro.task_id == "t-1"
    assert httpx.get(gw.url + f"/rollouts/{rid}", timeout=30).json()["status"] == "succeeded"


def test_streaming_passes_chunks_through_and_captures_tokens(gw: Gateway, store: TraceStore) -> None:
    rid = _create(gw)["id"]
    client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="sk-test")
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="m", messages=MSGS, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"x-test-delay": "0.05"})
    arrivals, text = [], []
    for chunk in stream:
        arrivals.append(time.perf_counter() - t0)
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    assert "".join(text) == "echo: what is 2+2?"
    # Relayed as produced (one chunk per 50 ms), not buffered until the end.
    assert len(arrivals) >= 6 and arrivals[-1] - arrivals[0] >= 0.05 * (len(arrivals) - 2) * 0.6
    _finish(gw, rid)
    [call] = store.calls(rid)
    assert call.stream and call.is_training and not call.partial and call.policy_version == 1
    assert call.completion_token_ids == tuple(tokenize("echo: what is 2+2?"))
    assert call.prompt_token_ids == tuple(tokenize(render_chat(MSGS)))


def test_stream_closed_early_by_client_is_partial(gw_lite: Gateway, sqlite_store: TraceStore) -> None:
    rid = _create(gw_lite)["id"]
    client = openai.OpenAI(base_url=gw_lite.rollout_base_url(rid), api_key="x")
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 50}], stream=True,
                                            extra_headers={"x-test-delay": "0.05"})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while gw_lite.state()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    _finish(gw_lite, rid)
    [call] = sqlite_store.calls(rid)
    assert call.partial and not call.is_training


def test_completions_models_and_header_addressing(gw_lite: Gateway, sqlite_store: TraceStore) -> None:
    rid = _create(gw_lite)["id"]
    client = openai.OpenAI(base_url=gw_lite.base_url, api_key="sk-test", default_headers={"x-rollout-id": rid})
    raw = client.completions.with_raw_response.create(model="m", prompt="hello", max_tokens=30)
    assert raw.parse().choices[0].text == "echo: hello"
    received = raw.headers["x-test-received-headers"].split(",")
    assert "x-rollout-id" not in received and "idempotency-key" not in received
    assert [m.id for m in client.models.list()] == ["test-model"]
    assert [m.id for m in openai.OpenAI(base_url=gw_lite.rollout_base_url(rid), api_key="x").models.list()] == [
        "test-model"]
    mismatch = httpx.post(gw_lite.rollout_base_url(rid) + "/chat/completions", json={"model": "m", "messages": MSGS},
                          headers={"x-rollout-id": "other"}, timeout=30)
    assert mismatch.status_code == 400 and "disagrees" in mismatch.json()["error"]["message"]
    unattached = httpx.post(gw_lite.base_url + "/chat/completions", json={"model": "m", "messages": MSGS}, timeout=30)
    assert unattached.status_code == 200
    _finish(gw_lite, rid)
    [call] = sqlite_store.calls(rid)
    assert call.endpoint == "completions" and call.is_training and call.completion_token_ids
    sqlite_store.flush()
    assert len(sqlite_store.calls(None)) == 1


def test_langchain_chat_openai_without_wrap(gw_lite: Gateway, sqlite_store: TraceStore) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    rid = _create(gw_lite)["id"]
    llm = langchain_openai.ChatOpenAI(base_url=gw_lite.rollout_base_url(rid), api_key="sk-test", model="m")
    assert llm.invoke("what is 2+2?").content == "echo: what is 2+2?"
    assert "".join(c.content for c in llm.stream("again")) == "echo: again"
    _finish(gw_lite, rid)
    calls = sqlite_store.calls(rid)
    assert len(calls) == 2 and all(c.is_training for c in calls) and [c.stream for c in calls] == [False, True]


# --------------------------------------------------------------------------
# curl and the CLI
# --------------------------------------------------------------------------

def _curl(*args: str) -> tuple[int, str]:
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=30)
    body, _, code = out.stdout.rpartition("\n")
    return int(code), body


def test_curl_against_the_cli_gateway(llm_server: LLMTestServer, tmp_path) -> None:
    db = tmp_path / "cli.db"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_middleware.cli", "gateway", "--upstream",
                             llm_server.base_url, "--store", f"sqlite:///{db}", "--port", str(port),
                             "--policy-version", "7", "--max-body-mb", "0.01"],
                            env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        j = ["-H", "content-type: application/json"]
        code, body = _curl(*j, "-d", '{"id": "curl-1", "task_id": "t"}', url + "/rollouts")
        assert code == 201 and json.loads(body)["base_url"].endswith("/rollouts/curl-1/v1")
        chat = json.dumps({"model": "m", "messages": MSGS})
        code, body = _curl(*j, "-d", chat, url + "/rollouts/curl-1/v1/chat/completions")
        assert code == 200 and json.loads(body)["choices"][0]["message"]["content"] == "echo: what is 2+2?"
        stream_body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "stream me"}], "stream": True})
        code, body = _curl("-N", *j, "-H", "x-rollout-id: curl-1", "-d", stream_body, url + "/v1/chat/completions")
        assert code == 200 and body.rstrip().endswith("data: [DONE]")
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in body.splitlines() if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert text == "echo: stream me"
        code, body = _curl(*j, "-d", "{not json", url + "/rollouts/curl-1/v1/chat/completions")
        assert code == 400 and json.loads(body)["error"]["code"] == "invalid_json"
        code, body = _curl(*j, "-d", json.dumps({"model": "m", "prompt": "x" * 20000}), url + "/v1/completions")
        assert code == 413 and "limit" in json.loads(body)["error"]["message"]
        assert _curl(*j, "-d", '{"value": 1}', url + "/rollouts/curl-1/reward")[0] == 200
        code, body = _curl(*j, "-X", "POST", url + "/rollouts/curl-1/finish")
        assert code == 200 and json.loads(body)["final_reward"] == 1.0
        code, body = _curl(url + "/admin/state")
        assert code == 200 and json.loads(body)["policy_version"] == 7
    finally:
        proc.terminate()
        proc.wait(10)
    store = TraceStore(f"sqlite:///{db}")
    calls = store.calls("curl-1")
    assert [(c.stream, c.is_training, c.policy_version) for c in calls] == [(False, True, 7), (True, True, 7)]
    assert store.get_rollout("curl-1").status == "succeeded"
    store.close()


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------

def test_clear_json_errors(gw_lite: Gateway) -> None:
    base = gw_lite.url

    def err(resp: httpx.Response, status: int, code: str) -> None:
        assert resp.status_code == status, resp.text
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["code"] == code and resp.json()["error"]["message"]

    chat = {"model": "m", "messages": MSGS}
    err(httpx.post(base + "/rollouts/nope/v1/chat/completions", json=chat, timeout=30), 404, "rollout_not_found")
    err(httpx.post(base + "/v1/chat/completions", json=chat, headers={"x-rollout-id": "nope"}, timeout=30), 404,
        "rollout_not_found")
    err(httpx.post(base + "/rollouts", json={"id": "x"}, timeout=30), 400, "bad_task_id")
    err(httpx.post(base + "/rollouts", json={"id": "bad id!", "task_id": "t"}, timeout=30), 400, "bad_rollout_id")
    err(httpx.post(base + "/rollouts", json={"task_id": "t", "mode": "eval"}, timeout=30), 400, "bad_mode")
    rid = _create(gw_lite, task="a")["id"]
    err(httpx.post(base + "/rollouts", json={"id": rid, "task_id": "b"}, timeout=30), 409, "rollout_conflict")
    err(httpx.post(base + f"/rollouts/{rid}/v1/chat/completions", content=b"{oops", timeout=30), 400, "invalid_json")
    err(httpx.post(base + f"/rollouts/{rid}/v1/chat/completions", json=[1, 2], timeout=30), 400, "invalid_json")
    err(httpx.post(base + f"/rollouts/{rid}/v1/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "x" * 70000}]},
                       timeout=30), 413, "body_too_large")
    err(httpx.post(base + f"/rollouts/{rid}/reward", json={"value": "high"}, timeout=30), 400, "bad_reward")
    err(httpx.post(base + f"/rollouts/{rid}/reward", json={"value": True}, timeout=30), 400, "bad_reward")
    err(httpx.post(base + f"/rollouts/{rid}/reward", content=b'{"value": NaN}',
                   timeout=30), 400, "invalid_json")  # not JSON
    err(httpx.post(base + f"/rollouts/{rid}/finish", json={"status": "great"}, timeout=30), 400, "bad_status")
    assert httpx.post(base + f"/rollouts/{rid}/fail", json={"error": "tool crashed"},
                      timeout=30).json()["status"] == "failed"
    assert httpx.post(base + f"/rollouts/{rid}/fail", json={"error": "tool crashed"},
                      timeout=30).status_code == 200  # retried
    err(_finish(gw_lite, rid), 409, "rollout_finished")
    err(httpx.post(base + f"/rollouts/{rid}/v1/chat/completions", json=chat, timeout=30), 409, "rollout_finished")
    err(httpx.post(base + f"/rollouts/{rid}/reward", json={"value": 1, "call_index": -1},
                   timeout=30), 400, "bad_call_index")
    err(httpx.post(base + f"/rollouts/{rid}/reward", json={"value": 1, "call_index": 0, "final": True},
                   timeout=30), 400, "bad_call_index")
    late = httpx.post(base + f"/rollouts/{rid}/reward", json={"value": 1},
                      timeout=30)  # kept after the finish (docs/rewards.md)
    assert late.status_code == 200 and late.json()["late"] is True and late.json()["applied"] is True
    err(httpx.get(base + "/nowhere", timeout=30), 404, "not_found")
    err(httpx.get(base + "/v1/chat/completions", timeout=30), 405, "method_not_allowed")


@pytest.mark.parametrize("depth", [20_000, 1_500, 1_000])
def test_deeply_nested_bodies_are_a_400_not_a_500(gw_lite: Gateway, sqlite_store: TraceStore, depth: int) -> None:
    """orjson stops at 1024 levels, the standard library overflows its stack a little later: both
    are a 400 that says so; a body that parses but is no chat request is the upstream's 400."""
    rid = _create(gw_lite)["id"]
    body = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    r = httpx.post(gw_lite.rollout_base_url(rid) + "/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]
    if depth > 1024:
        assert r.json()["error"]["code"] == "invalid_json" and "nested" in r.json()["error"]["message"]
    assert httpx.get(gw_lite.url + "/health", timeout=30).status_code == 200  # still up
    _finish(gw_lite, rid)
    assert not any(c.is_training for c in sqlite_store.calls(rid))


# --------------------------------------------------------------------------
# Idempotency and retries: one training call
# --------------------------------------------------------------------------

def test_idempotency_key_replays_the_stored_response(gw: Gateway, store: TraceStore) -> None:
    rid = _create(gw)["id"]
    client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="sk-test")
    a = client.chat.completions.with_raw_response.create(model="m", messages=MSGS, temperature=1.0,
                                                         extra_headers={"Idempotency-Key": "k1"})
    b = client.chat.completions.with_raw_response.create(model="m", messages=MSGS, temperature=1.0,
                                                         extra_headers={"Idempotency-Key": "k1"})
    assert a.http_response.content == b.http_response.content
    assert b.headers.get("x-lightning-replayed") == "1" and "x-lightning-replayed" not in a.headers
    conflict = httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json={"model": "m", "messages": []},
                          headers={"Idempotency-Key": "k1"}, timeout=30)
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_conflict"
    # A streamed call replays as the same event stream.
    body = {"model": "m", "messages": [{"role": "user", "content": "s"}], "stream": True}
    s1 = httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json=body, headers={"Idempotency-Key": "k2"},
                    timeout=30)
    s2 = httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json=body, headers={"Idempotency-Key": "k2"},
                    timeout=30)
    assert s1.content == s2.content and s1.content.rstrip().endswith(b"[DONE]")
    _finish(gw, rid)
    calls = store.calls(rid)
    assert len(calls) == 2 and all(c.is_training for c in calls)


def test_retry_storm_is_one_training_call(gw: Gateway, store: TraceStore) -> None:
    rid = _create(gw)["id"]
    url = gw.rollout_base_url(rid) + "/chat/completions"
    plain = {"model": "m", "messages": [{"role": "user", "content": "storm"}]}
    streamed = {"model": "m", "messages": [{"role": "user", "content": "storm stream"}], "stream": True}

    def send(body: dict) -> bytes:
        hdr = {"x-test-delay": "0.02", "x-stainless-retry-count": "1"}
        return httpx.post(url, json=body, headers=hdr, timeout=30).content

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(send, [plain] * 8 + [streamed] * 8))
    assert len(set(outs[:8])) == 1 and len(set(outs[8:])) == 1
    assert send(plain) == outs[0]  # a late retry of a finished call is answered from it
    _finish(gw, rid)
    calls = store.calls(rid)
    assert len(calls) == 2 and all(c.is_training for c in calls)
    assert gw.state()["counters"]["replayed"] >= 15


def test_identical_samples_that_are_not_retries_go_upstream(gw: Gateway, store: TraceStore) -> None:
    """Two identical temperature-1 requests in one rollout are two samples (the agent meant both);
    the openai SDK's retry of one of them is answered from it."""
    rid = _create(gw)["id"]
    url = gw.rollout_base_url(rid) + "/chat/completions"
    body = {"model": "m", "temperature": 1.0, "messages": [{"role": "user", "content": "sample me twice"}]}
    first = httpx.post(url, json=body, headers={"x-stainless-retry-count": "0"}, timeout=30)
    second = httpx.post(url, json=body, timeout=30)
    retry = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"}, timeout=30)
    assert "x-lightning-replayed" not in first.headers and "x-lightning-replayed" not in second.headers
    assert retry.headers["x-lightning-replayed"] == "1"
    _finish(gw, rid)
    calls = store.calls(rid)
    assert len(calls) == 2 and all(c.is_training for c in calls)  # the upstream saw two calls


def test_failed_upstream_attempts_are_recorded_not_trained(gw_lite: Gateway, sqlite_store: TraceStore) -> None:
    rid = _create(gw_lite)["id"]
    flaky = [{"role": "user", "content": f"flaky {uuid.uuid4().hex[:6]}"}]
    r = httpx.post(gw_lite.rollout_base_url(rid) + "/chat/completions", json={"model": "m", "messages": flaky},
                   headers={"x-test-fail-times": "1"}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    assert "HTTP 500" in r.json()["error"]["message"] and "injected failure" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=gw_lite.rollout_base_url(rid), api_key="x", max_retries=3)
    flaky2 = [{"role": "user", "content": f"flaky {uuid.uuid4().hex[:6]}"}]
    out = client.chat.completions.create(model="m", messages=flaky2, extra_headers={"x-test-fail-times": "2"})
    assert out.choices[0].message.content.startswith("echo: flaky")
    _finish(gw_lite, rid)
    calls = sqlite_store.calls(rid)
    assert [(c.status_code, c.is_training) for c in calls] == [(500, False), (500, False), (500, False), (200, True)]
    assert [c.attempt for c in calls[1:]] == [1, 2, 3]


class _Blackhole:
    """A TCP port that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def close(self) -> None:
        self.sock.close()


def test_upstream_down_is_502_and_stalled_is_504(sqlite_store: TraceStore, llm_server: LLMTestServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with Gateway([dead], sqlite_store, health_interval_s=0) as gw:
        rid = _create(gw)["id"]
        r = httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json={"model": "m", "messages": MSGS},
                       timeout=30)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        assert "ConnectError" in r.json()["error"]["message"]
        _finish(gw, rid, status="failed")
        [call] = sqlite_store.calls(rid)
        assert call.status_code is None and not call.is_training and "Connect" in call.error
    hole = _Blackhole()
    try:
        with Gateway([hole.url], sqlite_store, health_interval_s=0, upstream_timeout_s=0.5) as gw:
            rid = _create(gw)["id"]
            r = httpx.post(gw.rollout_base_url(rid) + "/chat/completions", json={"model": "m", "messages": MSGS},
                           timeout=30)
            assert r.status_code == 504 and r.json()["error"]["type"] == "upstream_timeout"
            _finish(gw, rid, status="failed")
            [call] = sqlite_store.calls(rid)
            assert not call.is_training and "Timeout" in call.error
    finally:
        hole.close()
    with Gateway([llm_server.base_url], sqlite_store, health_interval_s=0, upstream_timeout_s=0.3) as gw:
        rid = _create(gw)["id"]
        r = httpx.post(gw.rollout_base_url(rid) + "/chat/completions",
                       json={"model": "m", "messages": MSGS, "stream": True}, headers={"x-test-delay": "1"}, timeout=30)
        assert r.status_code == 504
        _finish(gw, rid, status="failed")
        [call] = sqlite_store.calls(rid)
        assert not call.is_training


# --------------------------------------------------------------------------
# Several upstreams
# --------------------------------------------------------------------------

def test_sticky_routing_health_and_failover(llm_server: LLMTestServer, sqlite_store: TraceStore) -> None:
    second = LLMTestServer().start()
    try:
        with Gateway([llm_server.base_url, second.base_url], sqlite_store, health_interval_s=0.2) as gw:
            rids = [_create(gw)["id"] for _ in range(12)]
            served: dict[str, set[str]] = {}
            for turn in range(3):
                for rid in rids:
                    r = httpx.post(gw.rollout_base_url(rid) + "/chat/completions",
                                   json={"model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}]},
                                       timeout=30)
                    assert r.status_code == 200
                    served.setdefault(rid, set()).add(r.headers["x-lightning-upstream"])
            assert all(len(s) == 1 for s in served.values())  # each rollout stays on one replica
            assert {next(iter(s)) for s in served.values()} == {"0", "1"}
            second.stop()
            for rid in rids:  # the lost replica's rollouts move, the others stay
                r = httpx.post(gw.rollout_base_url(rid) + "/chat/completions",
                               json={"model": "m", "messages": [{"role": "user", "content": "after"}]}, timeout=30)
                assert r.status_code == 200 and r.headers["x-lightning-upstream"] == "0"
            deadline = time.monotonic() + 30
            while gw.state()["upstreams"][1]["healthy"] and time.monotonic() < deadline:
                time.sleep(0.05)
            state = httpx.get(gw.url + "/admin/state", timeout=30).json()
            assert [u["healthy"] for u in state["upstreams"]] == [True, False]
            for rid in rids:
                _finish(gw, rid)
        training = [c for rid in rids for c in sqlite_store.calls(rid) if c.is_training]
        assert len(training) == 12 * 4
    finally:
        second.stop()


# --------------------------------------------------------------------------
# Pause and drain for weight swaps
# --------------------------------------------------------------------------

def test_pause_during_a_stream_drains_it_and_versions_calls(gw: Gateway, store: TraceStore,
                                                            llm_server: LLMTestServer) -> None:
    rid = _create(gw)["id"]
    client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="x", timeout=30)
    got: dict = {}
    first_chunk = threading.Event()
    hold = f"pause-{uuid.uuid4().hex}"  # the engine holds the stream after its first chunk until released

    def stream() -> None:
        s = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "a long answer to stream while pausing"}], stream=True,
            extra_headers={"x-test-hold": hold})
        got["stream_version"] = s.headers["x-lightning-policy-version"]
        parts = []
        for chunk in s.parse():
            first_chunk.set()
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        got["text"] = "".join(parts)

    def later_call() -> None:
        r = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "later"}])
        got["later"] = (time.monotonic(), r.headers["x-lightning-policy-version"])

    def pause() -> None:
        got["paused"] = gw.pause(wait=True, timeout=20)  # returns once the stream has finished

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(30)
    assert httpx.get(gw.url + "/admin/state", timeout=30).json()["in_flight"] == 1
    pausing = threading.Thread(target=pause)
    pausing.start()
    deadline = time.monotonic() + 30
    while not httpx.get(gw.url + "/admin/state", timeout=30).json()["paused"] and time.monotonic() < deadline:
        time.sleep(0.01)
    state = httpx.get(gw.url + "/admin/state", timeout=30).json()
    assert state["paused"] and state["in_flight"] == 1 and "paused" not in got  # the pause waits on the stream
    llm_server.release(hold)
    pausing.join(20)
    paused = got["paused"]
    assert paused["drained"] and paused["in_flight"] == 0 and paused["paused"]
    t.join(10)
    assert got["text"] == "echo: a long answer to stream while pausing" and got["stream_version"] == "1"
    waiting = threading.Thread(target=later_call)
    waiting.start()
    deadline = time.monotonic() + 30
    while httpx.get(gw.url + "/admin/state", timeout=30).json()["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    state = httpx.get(gw.url + "/admin/state", timeout=30).json()
    assert state["waiting"] == 1 and "later" not in got  # it reached the gateway and waits out the pause
    assert state["paused"] and state["in_flight"] == 0
    resumed_at = time.monotonic()
    assert httpx.post(gw.url + "/admin/resume", json={"policy_version": 2}, timeout=30).json()["policy_version"] == 2
    waiting.join(10)
    assert got["later"][0] >= resumed_at and got["later"][1] == "2"
    _finish(gw, rid)
    calls = store.calls(rid)
    assert [(c.stream, c.is_training, c.policy_version) for c in calls] == [(True, True, 1), (False, True, 2)]


def test_new_version_applies_to_calls_started_after_it(gw: Gateway, store: TraceStore) -> None:
    rid = _create(gw)["id"]
    url = gw.rollout_base_url(rid) + "/chat/completions"
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "in flight across a version bump"}]}
    with httpx.stream("POST", url, json=body, headers={"x-test-delay": "0.03"}, timeout=30) as r:
        chunks = r.iter_raw()
        next(chunks)
        assert httpx.post(gw.url + "/admin/resume", json={"policy_version": 5},
                          timeout=30).json()["policy_version"] == 5
        after = httpx.post(url, json={"model": "m", "messages": MSGS}, timeout=30)
        rest = b"".join(chunks)
    assert r.headers["x-lightning-policy-version"] == "1" and rest.rstrip().endswith(b"[DONE]")
    assert after.headers["x-lightning-policy-version"] == "5"
    _finish(gw, rid)
    calls = store.calls(rid)
    assert sorted((c.stream, c.policy_version, c.is_training) for c in calls) == [(False, 5, True), (True, 1, True)]


def test_pause_reject_mode_and_wait_bound(llm_server: LLMTestServer, sqlite_store: TraceStore) -> None:
    with Gateway([llm_server.base_url], sqlite_store, pause_wait_s=0.3, retry_after_s=3) as gw:
        chat = {"model": "m", "messages": MSGS}
        paused = httpx.post(gw.url + "/admin/pause", json={"wait": False, "mode": "reject"}, timeout=30).json()
        assert paused["paused"] and paused["pause_mode"] == "reject"
        r = httpx.post(gw.base_url + "/chat/completions", json=chat, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "3" and r.json()["error"]["type"] == "paused"
        httpx.post(gw.url + "/admin/pause", json={"wait": False, "mode": "wait"}, timeout=30)
        t0 = time.monotonic()
        r = httpx.post(gw.base_url + "/chat/completions", json=chat, timeout=30)
        assert r.status_code == 429 and 0.25 < time.monotonic() - t0 < 20  # bounded: the client would wait 30
        assert httpx.post(gw.url + "/admin/resume", timeout=30).status_code == 200
        assert httpx.post(gw.base_url + "/chat/completions", json=chat, timeout=30).status_code == 200
        assert gw.state()["counters"]["rejected_paused"] == 2


# --------------------------------------------------------------------------
# Security
# --------------------------------------------------------------------------

def test_non_loopback_bind_needs_a_token(sqlite_store: TraceStore) -> None:
    with pytest.raises(GatewayConfigError, match="token"):
        Gateway(["http://127.0.0.1:1/v1"], sqlite_store, host="0.0.0.0")
    Gateway(["http://127.0.0.1:1/v1"], sqlite_store, host="0.0.0.0", token="t0k")  # accepted
    out = subprocess.run([sys.executable, "-m", "lightning_middleware.cli", "gateway", "--upstream",
                          "http://127.0.0.1:1/v1", "--host", "0.0.0.0", "--store", "sqlite:///:memory:"],
                         env={**os.environ, "PYTHONPATH": ROOT, "LIGHTNING_GATEWAY_TOKEN": ""},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "refusing to listen on 0.0.0.0" in out.stderr


def test_token_required_and_secrets_never_stored(llm_server: LLMTestServer, sqlite_store: TraceStore) -> None:
    token = "gw-secret-token-123"
    with Gateway([llm_server.base_url], sqlite_store, token=token) as gw:
        assert httpx.get(gw.url + "/health", timeout=30).status_code == 200  # probes need no token
        for method, path in (("POST", "/rollouts"), ("GET", "/admin/state"), ("POST", "/admin/pause"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            r = httpx.request(method, gw.url + path, json={}, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(gw.url + "/admin/state", headers={"authorization": "Bearer wrong"},
                         timeout=30).status_code == 401
        rid = _create(gw)["id"]
        client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key=token)
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=MSGS, extra_body={"api_key": "sk-body-secret-456",
                                                  "extra_headers": {"Authorization": "Bearer sk-nested-789"}},
            extra_headers={"x-api-key": "sk-header-secret-000"})
        assert raw.parse().choices[0].message.content == "echo: what is 2+2?"
        received = raw.headers["x-test-received-headers"].split(",")
        assert "authorization" not in received and "x-api-key" not in received
        assert _finish(gw, rid).status_code == 200
    with sqlite_store.engine.connect() as conn:
        dump = json.dumps([[str(v) for v in row] for row in conn.execute(sa.text("SELECT * FROM llm_calls"))])
    assert "what is 2+2?" in dump
    for secret in (token, "sk-body-secret-456", "sk-nested-789", "sk-header-secret-000"):
        assert secret not in dump


def test_admin_client_contract_pause_resume_with_version_and_token(llm_server: LLMTestServer,
                                                                    sqlite_store: TraceStore) -> None:
    """The one contract the weight publisher uses: pause drains, resume sets the version that
    the calls after it are stamped with, and every admin call carries the bearer token."""
    from lightning_middleware.gateway.admin import GatewayAdmin, GatewayAdminError

    with Gateway([llm_server.base_url], sqlite_store, token="s3cret", health_interval_s=0, policy_version=4) as g:
        with pytest.raises(GatewayAdminError, match="401"):
            GatewayAdmin(g.url).pause()
        with pytest.raises(GatewayAdminError, match="401"):
            GatewayAdmin(g.url, token="wrong").resume(policy_version=9)
        admin = GatewayAdmin(g.url, token="s3cret")
        paused = admin.pause(timeout=5)
        assert paused["paused"] and paused["drained"] and admin.state()["paused"]
        resumed = admin.resume(policy_version=7)
        assert resumed["policy_version"] == 7 and not resumed["paused"]
        assert admin.resume()["policy_version"] == 7  # no version given: it stays
        rid = "r-" + uuid.uuid4().hex[:8]
        auth = {"authorization": "Bearer s3cret"}
        assert httpx.post(g.url + "/rollouts", json={"id": rid, "task_id": "t"}, headers=auth,
                          timeout=30).status_code == 201
        r = httpx.post(g.rollout_base_url(rid) + "/chat/completions", headers=auth,
                       json={"model": "m", "messages": [{"role": "user", "content": "after the swap"}]}, timeout=30)
        assert r.status_code == 200 and r.headers["x-lightning-policy-version"] == "7"
        assert httpx.post(g.url + f"/rollouts/{rid}/finish", json={}, headers=auth, timeout=30).status_code == 200
        [call] = sqlite_store.calls(rid)
        assert call.policy_version == 7
        assert sqlite_store.get_rollout(rid).policy_version == 7  # created after the resume: version 7


def test_scrub_secrets_keeps_everything_else() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": MSGS, "api_key": "k", "Authorization": "a",
            "tools": [{"function": {"parameters": {"properties": {"password": {"type": "string"}}}}}]}
    out, changed = scrub_secrets(body)
    assert changed and set(out) == {"model", "max_tokens", "messages", "tools"} and out["tools"] == body["tools"]
    assert scrub_secrets({"model": "m"}) == ({"model": "m"}, False)


def test_importing_the_package_and_cli_stays_light() -> None:
    code = ("import sys, lightning_middleware, lightning_middleware.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('starlette', 'uvicorn', 'fastapi', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_rendezvous_is_stable_and_moves_only_lost_keys() -> None:
    from lightning_middleware.gateway.upstreams import Upstream, rendezvous

    ups = [Upstream(i, f"http://h{i}") for i in range(3)]
    before = {k: rendezvous(k, ups).index for k in map(str, range(300))}
    after = {k: rendezvous(k, ups[:2]).index for k in before}
    assert all(after[k] == v for k, v in before.items() if v != 2)
    counts = [list(before.values()).count(i) for i in range(3)]
    assert min(counts) > 60 and not math.isnan(sum(counts))


def test_upstream_client_errors_pass_through(gw_lite: Gateway, sqlite_store: TraceStore) -> None:
    rid = _create(gw_lite)["id"]
    r = httpx.post(gw_lite.rollout_base_url(rid) + "/chat/completions",
                   json={"model": "m", "messages": MSGS, "bogus_field": 1}, headers={"x-test-strict": "1"}, timeout=30)
    assert r.status_code == 400 and "unknown fields" in r.json()["error"]["message"]  # vLLM's own 4xx, as sent
    # the agent's own 400 is not taken for a refusal of the injected fields: later calls train
    ok = httpx.post(gw_lite.rollout_base_url(rid) + "/chat/completions", json={"model": "m", "messages": MSGS},
                    timeout=30)
    assert ok.status_code == 200
    _finish(gw_lite, rid)
    calls = sqlite_store.calls(rid)
    assert [c.status_code for c in calls] == [400, 200]
    assert not calls[0].is_training and calls[1].is_training and calls[1].completion_token_ids


def test_upstream_rejecting_the_injected_fields_never_fails_the_call(gw_lite: Gateway,
                                                                      sqlite_store: TraceStore) -> None:
    # A server that 400s on return_token_ids/logprobs (not vLLM): the caller's own request is resent as
    # written and answered; the gateway stops injecting for that host; the calls are kept, untrainable.
    rid = _create(gw_lite)["id"]
    for i in range(2):
        r = httpx.post(gw_lite.rollout_base_url(rid) + "/chat/completions", headers={"x-test-strict": "1"},
                       json={"model": "m", "messages": [{"role": "user", "content": f"strict {i}"}]}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == f"echo: strict {i}"
    _finish(gw_lite, rid)
    calls = sqlite_store.calls(rid)
    assert [(c.status_code, c.is_training) for c in calls] == [(200, False), (200, False)]
    assert all("return_token_ids" not in c.request for c in calls)


def test_replay_cache_is_bounded(llm_server: LLMTestServer, sqlite_store: TraceStore) -> None:
    with Gateway([llm_server.base_url], sqlite_store, max_cached_responses=5) as gw:
        rid = _create(gw)["id"]
        for i in range(40):
            r = httpx.post(gw.rollout_base_url(rid) + "/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": f"n{i}"}]}, timeout=30)
            assert r.status_code == 200
        assert len(gw.replay) <= 6
        _finish(gw, rid)


def test_store_outage_is_a_503(gw_lite: Gateway, sqlite_store: TraceStore, monkeypatch) -> None:
    def down(*_a, **_k):
        raise sa.exc.OperationalError("INSERT", {}, Exception("database is gone"))

    monkeypatch.setattr(sqlite_store, "create_rollout", down)
    r = httpx.post(gw_lite.url + "/rollouts", json={"task_id": "t"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable" and r.headers["retry-after"]


def test_test_server_cpu_ms_computes_each_completion_on_a_core():
    """The benchmark's CPU-bound engine (`--engine-cpu-ms`): each completion burns its CPU time, one at a time."""
    with LLMTestServer(cpu_ms=40) as srv:
        def cpu_s() -> float:
            seconds = process_cpu_seconds(srv.pid)  # type: ignore[arg-type]
            assert seconds is not None
            return seconds

        body = {"model": "m", "messages": MSGS}
        httpx.post(srv.base_url + "/chat/completions", json=body, timeout=30).raise_for_status()  # warm
        c0, t0 = cpu_s(), time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 4 at once still take 4 x 40 ms: serial
            codes = list(pool.map(lambda _: httpx.post(srv.base_url + "/chat/completions", json=body,
                                                       timeout=30).status_code, range(4)))
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    assert codes == [200] * 4
    assert wall >= 0.16 and cpu >= 0.14, (wall, cpu)  # 4 x 40 ms, less a clock tick of rounding
