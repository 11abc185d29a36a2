"""Fault matrix, upstream cells: an engine that answers 5xx, hangs, or drops the connection mid-stream.

Through `wrap()` (the agent's own openai client) and through the gateway (a real uvicorn server):
the agent sees an upstream error, never one of ours; the attempt is recorded, failed, and never
a training call. The upstream is the deterministic test LLM server with its fault headers
(`x-test-fail-times`, `x-test-hang`, `x-test-close-after`, lightning_middleware/testing/llm_script.py).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.gateway import Gateway
from lightning_middleware.testing import LLMTestServer
from tests.faults.matrix import Cell, report, wait_for

FAULTS = {  # cell -> (headers, stream)
    "5xx": ({"x-test-fail-times": "1"}, False),
    "hang": ({"x-test-hang": "5"}, False),  # past the clients' 2 s timeout, with room under load
    "closed mid-stream": ({"x-test-close-after": "2"}, True),
}


def _timeout(fault: str) -> float:
    """2 s only where the timeout is the fault: elsewhere an answer later than that on a loaded
    machine would end as a timeout, not as the fault the test injected."""
    return 2.0 if fault == "hang" else 60.0


def _messages() -> list[dict[str, str]]:
    # The server counts x-test-fail-times per distinct body: each call its own.
    return [{"role": "user", "content": f"fault {uuid.uuid4().hex[:8]}"}]


@pytest.fixture
def sq(tmp_path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'faults.db'}")
    yield s
    s.close()


def _call(client: openai.OpenAI, headers: dict[str, str], stream: bool) -> None:
    if stream:
        for _ in client.chat.completions.create(model="m", messages=_messages(), stream=True, extra_headers=headers):
            pass
    else:
        client.chat.completions.create(model="m", messages=_messages(), extra_headers=headers)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_upstream_fault_through_wrap(fault: str, llm_server: LLMTestServer, sq: TraceStore) -> None:
    headers, stream = FAULTS[fault]
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x", max_retries=0, timeout=_timeout(fault)),
                  store=sq)
    with pytest.raises(openai.APIError) as err, rollout("upstream-fault", store=sq) as r:
        _call(client, headers, stream)
    # The agent sees the engine's failure as the openai SDK reports it: a status error, a timeout, a cut stream.
    assert isinstance(err.value, {"5xx": openai.InternalServerError, "hang": openai.APITimeoutError,
                                  "closed mid-stream": openai.APIConnectionError}[fault])
    calls = sq.calls(r.id)
    assert sq.get_rollout(r.id).status == "failed"
    _check_recorded_failed(calls, fault)
    report(Cell(f"upstream {fault} (wrap)", sent=1, recorded=len(calls), lost=0,
                note=f"agent got {type(err.value).__name__}; recorded: {_summary(calls[0])}"))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_upstream_fault_through_the_gateway(fault: str, llm_server: LLMTestServer, sq: TraceStore) -> None:
    headers, stream = FAULTS[fault]
    with Gateway([llm_server.base_url], sq, health_interval_s=0, upstream_timeout_s=_timeout(fault)) as gw:
        rid = httpx.post(gw.url + "/rollouts", json={"task_id": "upstream-fault"}, timeout=30).json()["id"]
        client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.APIError) as err:
            _call(client, headers, stream)
        # 5xx -> 502 upstream_error, hang -> 504 upstream_timeout; a stream cut after its 200 reaches the
        # agent as a cut stream (the status line was sent before the engine died).
        expected = {"5xx": openai.InternalServerError, "hang": openai.InternalServerError,
                    "closed mid-stream": openai.APIConnectionError}[fault]
        assert isinstance(err.value, expected), repr(err.value)
        if fault != "closed mid-stream":
            assert err.value.status_code == {"5xx": 502, "hang": 504}[fault]  # type: ignore[attr-defined]
        assert httpx.post(gw.url + f"/rollouts/{rid}/fail", json={"error": "upstream"}, timeout=30).status_code == 200
        calls = sq.calls(rid)
    _check_recorded_failed(calls, fault)
    report(Cell(f"upstream {fault} (gateway)", sent=1, recorded=len(calls), lost=0,
                note=f"agent got {type(err.value).__name__}; recorded: {_summary(calls[0])}"))


def _check_recorded_failed(calls: list, fault: str) -> None:
    [call] = calls  # recorded once, as the failed attempt it was
    assert not call.is_training
    if fault == "5xx":
        assert call.status_code == 500 and "injected failure" in (call.error or "")
    elif fault == "hang":
        assert call.status_code is None and "Timeout" in (call.error or "")
    else:
        assert call.partial and call.finish_reason is None


def _summary(call) -> str:
    return (f"status {call.status_code}, partial={call.partial}, training={call.is_training}, "
            f"error={(call.error or '')[:60]!r}")


def test_the_test_server_counts_a_tagged_request_as_it_arrives(llm_server: LLMTestServer) -> None:
    """`x-test-tag`: the probe the kill tests wait on (a call at the engine, not a guessed delay), so it
    must count a request before the request is answered, and count each tag apart."""
    tag = uuid.uuid4().hex
    assert llm_server.seen(tag) == 0
    body = {"model": "m", "messages": _messages()}
    hung = threading.Thread(target=lambda: httpx.post(llm_server.base_url + "/chat/completions", json=body, timeout=30,
                                                      headers={"x-test-tag": tag, "x-test-hang": "5"}), daemon=True)
    hung.start()
    wait_for("the hanging request counted", lambda: llm_server.seen(tag) == 1, timeout=30)
    assert hung.is_alive()  # counted while it still hangs, unanswered
    assert llm_server.seen(uuid.uuid4().hex) == 0
    hung.join(30)
