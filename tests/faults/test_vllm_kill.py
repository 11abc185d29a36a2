"""Fault matrix, engine cell on a real vLLM CPU server: killed with SIGKILL mid-rollout.

Its own server (never the session's shared one), on the suite's tiny tied model, so the test
is slow (a vLLM start is 25-40 s here). Four streaming rollouts run under the controller; the
server's process group is killed once all four streams flow at once, and is not brought back: the
stream that started last has most of its tokens still to generate, so at least one is cut (a timed
kill after the first token could land when the tiny model had already finished every stream, as it
did on an AMX Xeon's first, cold run). The agent sees
`openai.APIConnectionError`; the controller retries each rollout (an infrastructure error), the
retries find no server, and every rollout ends `failed`. Nothing half-recorded is trainable:
cut streams are `partial`, refused calls failed, and the trainer never takes a failed rollout.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from lightning_middleware import TraceStore, wrap
from lightning_middleware.controller import RetryPolicy, RolloutController
from tests.faults.matrix import Cell, report

ROLLOUTS = 4


@pytest.mark.slow
def test_vllm_killed_mid_rollout(vllm_python: Path, tied_checkpoints: Any, tmp_path: Path) -> None:
    from trainer_backend.serving.server import VLLMServer

    store = TraceStore(f"sqlite:///{tmp_path / 'vllm-kill.db'}")
    server = VLLMServer(tied_checkpoints.base, python=vllm_python, dtype="float32", served_model_name="tiny-kill",
                        log_path=tmp_path / "vllm.log", max_model_len=1024).start()
    client = wrap(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30), store=store)
    flowing = threading.Event()
    open_streams: set[int] = set()
    lock = threading.Lock()
    killed = threading.Event()
    late = threading.Event()  # the next chunk any stream receives kills the server

    def kill() -> None:  # under `lock`, once
        if not killed.is_set():
            assert server.pid is not None
            os.killpg(server.pid, signal.SIGKILL)
            killed.set()

    def agent(task: dict[str, Any]) -> float:
        messages = [{"role": "user", "content": f"{task['task_id']}: tell a long story"}]
        for _ in range(3):
            text = ""
            stream_id = id(messages)
            for chunk in client.chat.completions.create(model="tiny-kill", messages=messages,  # type: ignore[arg-type]
                                                        stream=True, max_tokens=256,
                                                        extra_body={"ignore_eos": True}):
                flowing.set()
                with lock:
                    open_streams.add(stream_id)
                    if len(open_streams) == ROLLOUTS or late.is_set():
                        kill()  # from here: this stream has its first tokens and is certainly cut
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            with lock:
                open_streams.discard(stream_id)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        return 1.0

    # Where the four never flow at once: a kill 2 s after the first token, from inside an open stream
    # (a kill between two calls, on a slow or loaded machine, cut none), or at 30 s whatever flows.
    def kill_late() -> None:
        flowing.wait(120)
        time.sleep(2.0)
        late.set()
        if not killed.wait(28.0):
            with lock:
                kill()

    killer = threading.Thread(target=kill_late, daemon=True)
    killer.start()
    t0 = time.monotonic()
    try:
        with RolloutController(agent, store=store, backend="thread", concurrency=ROLLOUTS,
                               retry=RetryPolicy(max_attempts=2, backoff_s=0.2)) as c:
            results = c.run([{"task_id": f"v{i}"} for i in range(ROLLOUTS)])
        elapsed = time.monotonic() - t0
    finally:
        killer.join(5)
        server.stop()
    attempts = [rid for r in results for rid in r.rollout_ids]
    calls = [call for rid in attempts for call in store.calls(rid)]
    assert all(r.status == "failed" and "APIConnectionError" in (r.error or "") for r in results), results
    assert all(store.get_rollout(rid).status == "failed" for rid in attempts)  # type: ignore[union-attr]
    assert not store.query_rollouts(status="running")
    cut = [call for call in calls if call.partial]
    assert cut and not any(call.is_training for call in cut)
    assert all(call.is_training for call in calls if call.status_code == 200 and not call.partial)
    report(Cell("vLLM killed mid-rollout (not restarted)", sent=len(calls), recorded=len(calls), lost=0,
                note=f"{len(attempts)} attempts of {ROLLOUTS} rollouts, all failed (APIConnectionError), "
                     f"the controller done {elapsed:.1f}s after starting; "
                     f"{len(cut)} cut streams recorded partial, none trainable; vLLM start {server.startup_s:.0f}s"))
    store.close()
