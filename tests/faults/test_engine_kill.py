"""Fault matrix, engine cell: the inference server's process killed with SIGKILL mid-rollout.

The engine is the deterministic test LLM server, a real separate process (killing the suite's
shared vLLM server is not an option, and a second one takes minutes to start; from the agent's
side of the socket a killed vLLM looks the same: streams cut, then connections refused). Eight
rollouts of a streaming three-turn agent run under the rollout controller (thread backend,
four at a time); the engine is killed while streams are open and started again on its port a
second later. The agent sees the failure as `openai.APIConnectionError`, an infrastructure
error: the controller retries the rollout as a new attempt (its backoff must outlast the
engine's restart: here 6 attempts from 0.5 s doubling; the default 3 from 0.2 s gave up first).
Nothing half-recorded is trainable: cut streams are recorded partial, not training calls, in
rollouts that ended failed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import openai
import pytest

from lightning_middleware import TraceStore, wrap
from lightning_middleware.controller import RetryPolicy, RolloutController
from lightning_middleware.testing import LLMTestServer
from tests.faults.matrix import Cell, report, wait_for

ROLLOUTS, TURNS = 8, 3


class Streams:
    """How many of the agents' streams are open (their first chunk read, their last not yet), and
    an event set once `enough` are open at one moment."""

    def __init__(self, enough: int) -> None:
        self.enough, self.open, self.lock = enough, 0, threading.Lock()
        self.several = threading.Event()

    def opened(self) -> None:
        with self.lock:
            self.open += 1
            if self.open >= self.enough:
                self.several.set()

    def closed(self) -> None:
        with self.lock:
            self.open -= 1


def _agent(client: openai.OpenAI, streams: Streams) -> Any:
    def agent(task: dict[str, Any]) -> float:
        messages = [{"role": "user", "content": f"{task['task_id']} tell me something long enough"}]
        for _ in range(TURNS):
            text, first = "", True
            stream = client.chat.completions.create(model="m", messages=messages, stream=True, max_tokens=40,
                                                    extra_headers={"x-test-delay": "0.02"})
            try:
                for chunk in stream:
                    if first:
                        streams.opened()
                        first = False
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
            finally:
                if not first:
                    streams.closed()
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        return 1.0
    return agent


@pytest.mark.slow
def test_engine_killed_mid_rollout(tmp_path) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'engine.db'}")
    engine = LLMTestServer().start()
    client = wrap(openai.OpenAI(base_url=engine.base_url, api_key="x", max_retries=0, timeout=30), store=store)
    streams = Streams(enough=2)  # of the controller's 4 at a time
    restarted = threading.Event()
    down: dict[str, float] = {}

    def kill_and_restart() -> None:
        streams.several.wait(60)  # several rollouts are mid-stream, however fast this machine is
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        down["at"] = time.monotonic()
        engine.stop()  # reaps the killed process
        time.sleep(1.0)
        engine.start()
        down["up_s"] = time.monotonic() - down["at"]
        restarted.set()

    killer = threading.Thread(target=kill_and_restart, daemon=True)
    killer.start()
    tasks = [{"task_id": f"e{i}"} for i in range(ROLLOUTS)]
    try:
        with RolloutController(_agent(client, streams), store=store, backend="thread", concurrency=4,
                               retry=RetryPolicy(max_attempts=6, backoff_s=0.5)) as c:
            results = c.run(tasks)
        wait_for("the engine to come back", restarted.is_set, timeout=30)
    finally:
        engine.stop()
    attempts = [rid for r in results for rid in r.rollout_ids]
    calls = [call for rid in attempts for call in store.calls(rid)]
    retried = [r for r in results if r.attempts > 1]
    assert retried, "the kill hit no rollout"
    assert all(r.status == "succeeded" for r in results), [(r.status, r.error) for r in results]
    cut = [call for call in calls if not call.is_training]
    assert cut and all(call.partial or call.status_code is None for call in cut)
    for r in results:
        *failed, last = r.rollout_ids
        for rid in failed:  # each failed attempt: failed, and none of its calls is half-recorded and trainable
            ro = store.get_rollout(rid)
            assert ro.status == "failed" and "APIConnectionError" in (ro.error or ""), ro
            assert all(not call.partial for call in store.calls(rid) if call.is_training)
        last_calls = store.calls(last)
        assert len(last_calls) == TURNS and all(call.is_training for call in last_calls)
    report(Cell("engine killed mid-rollout (test LLM process)", sent=len(calls), recorded=len(calls), lost=0,
                recovery_s=round(down["up_s"], 2),
                note=f"{len(retried)} of {ROLLOUTS} rollouts retried by the controller, all succeeded; "
                     f"{len(cut)} cut/refused calls recorded, none trainable"))
    store.close()
