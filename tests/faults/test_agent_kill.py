"""Fault matrix, agent cells: the agent process killed with SIGKILL at three moments.

What the store holds afterwards: every call the agent had answered before the kill is there
(the kill comes once they are on disk: the background writer writes within `writer_interval_s`
on a quiet machine, and the test waits for that, not a guess at it); the call in
flight or the stream half read is not recorded at all (a record is made when a response ends,
and the process ended first). The rollout left running is reaped as failed by the lease reaper
once its lease goes stale, and the trainer never takes a failed rollout, so nothing
half-recorded becomes a training call. A finished rollout is untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.controller import reap_stale
from lightning_middleware.testing import LLMTestServer
from tests.faults.matrix import Cell, kill9, report, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEASE_S = 1.0  # the reaper's staleness bound here (the controller's default lease_s is longer)


def _start(mode: str, url: str, llm: LLMTestServer) -> tuple[subprocess.Popen[str], str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.faults.agent_proc", mode, url, llm.base_url],
                            env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        kill9(proc)
        raise AssertionError(f"agent did not get ready: {line!r} {proc.stderr.read()[-2000:] if proc.stderr else ''}")
    _, rid, answered = line.split()
    return proc, rid, int(answered)


@pytest.mark.parametrize("mode", ["nonstream", "stream", "between"])
def test_agent_killed(mode: str, llm_server: LLMTestServer, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'agent.db'}"
    TraceStore(url).close()  # the schema exists before the agent and the test open it
    proc, rid, answered = _start(mode, url, llm_server)
    store = TraceStore(url)
    first = rid.removesuffix("-b")

    def ready_to_kill() -> bool:
        """The moment the mode names, on any machine's speed: what was answered is on disk (the agent's
        writer runs every 50 ms) and the nonstream call in flight has reached the engine."""
        finished = store.get_rollout(rid if mode == "between" else first)
        return (finished is not None and finished.status == "succeeded" and len(store.calls(rid)) == answered
                and (mode != "nonstream" or llm_server.seen(rid) == 1))

    try:
        wait_for("the agent's answered calls on disk and its last call at the engine", ready_to_kill,
                 timeout=60, every=0.02)
    finally:
        kill9(proc)
    killed_at = time.monotonic()
    reaped: list[str] = []

    def reap() -> bool:
        reaped.extend(reap_stale(store, LEASE_S))
        return rid in reaped or mode == "between"

    wait_for("the reaper to end the killed rollout", reap, timeout=30, every=0.1)
    recovery = time.monotonic() - killed_at
    if mode == "between":
        ro = store.get_rollout(rid)
        assert ro.status == "succeeded" and ro.final_reward == 1.0  # finished before the kill: whole
        calls = store.calls(rid)
        sent = recorded = len(calls)
        assert recorded == answered == 2 and all(c.is_training for c in calls)
        assert reaped == []  # nothing was left running
    else:
        ro = store.get_rollout(rid)
        assert ro.status == "failed" and "lease expired" in (ro.error or "")
        assert store.get_rollout(first).status == "succeeded" and len(store.calls(first)) == 1
        calls = store.calls(rid)
        # The answered call is stored, complete; the one in flight / half read is not stored at all.
        assert len(calls) == answered == 1 and all(c.is_training and not c.partial for c in calls)
        assert not store.query_rollouts(status="running")  # nothing left for anyone to wait on
        sent, recorded = answered + 1 + 1, answered + 1  # + the first rollout's call, + the killed one
    report(Cell(f"agent killed ({mode})", sent=sent, recorded=recorded, lost=0,
                recovery_s=round(recovery, 2) if mode != "between" else 0.0,
                note="unanswered call not recorded; rollout reaped failed" if mode != "between" else
                "finished rollout whole"))
    store.close()
