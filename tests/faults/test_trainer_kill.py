"""Fault matrix, trainer cells: the trainer daemon killed with SIGKILL mid-step, after saving a
checkpoint and before publishing it, and after publishing it and before committing the step.

One store, one weights server (tests/faults/vllm_standin.py: the routes a publish calls, on a
real socket, able to hold a call so the kill lands at an observed moment), and four runs of
`lightning-mw trainer --serve`: the first three are killed at the three moments of step 1,
the fourth trains everything. Afterwards: no rollout trained twice, none left unconsumed, steps
and policy versions contiguous, and the server serves the version the store committed last,
loaded from that version's checkpoint. The third kill leaves the server ahead of the store (it
serves step 1's weights, the store has no version): the restart must publish the committed
weights (here: the base model) again.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.testing import LLMTestServer
from tests.faults.matrix import Cell, kill9, report, wait_for
from tests.faults.vllm_standin import Hold, VLLMStandIn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS, GROUP, PER_STEP = 12, 4, 2
STEPS = TASKS * GROUP // (GROUP * PER_STEP)


NOTES = {
    "mid-step": "claims released at restart, step redone",
    "after save": "uncommitted checkpoint overwritten, step redone",
    "after publish": "server ahead of the store: restart republishes the committed weights",
}


def _rollouts(llm: LLMTestServer, store: TraceStore) -> None:
    client = wrap(openai.OpenAI(base_url=llm.base_url, api_key="x"), store=store)
    for t in range(TASKS):
        for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
            with rollout(f"t{t}", store=store) as r:
                client.chat.completions.create(model="m", max_tokens=12,
                                               messages=[{"role": "user", "content": f"t{t} try {i}"}])
                r.reward(reward)
    store.flush()


def _model(out: Path) -> Path:
    from tests.trainer.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(out, vocab=260, hidden=32, layers=1, heads=2, kv_heads=1, max_positions=1024)


class Runs:
    """Starts `lightning-mw trainer` runs against one store and weights server."""

    def __init__(self, url: str, model: Path, ckpt: Path, serve: str, logs: Path) -> None:
        self.cmd = [sys.executable, "-m", "lightning_middleware.cli", "trainer", "--store", url, "--model",
                    str(model), "--checkpoints", str(ckpt), "--serve", serve, "--group-size", str(GROUP),
                    "--groups-per-step", str(PER_STEP), "--lr", "1e-3"]
        self.logs, self.n = logs, 0

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        self.n += 1
        log = open(self.logs / f"run{self.n}.log", "wb")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(self.cmd + list(extra), env={**os.environ, "PYTHONPATH": ROOT}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, n: int) -> str:
        return (self.logs / f"run{n}.log").read_text(errors="replace")[-3000:]


def _claimed(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM rollouts WHERE claimed_by IS NOT NULL "
                                "AND consumed_step IS NULL").fetchone()[0])


def _hold_and_kill(runs: Runs, srv: VLLMStandIn, hold: Hold) -> tuple[float, float]:
    """Start a run, kill it when `hold` is reached; (seconds to reach it, time of the kill)."""
    srv.hold = hold
    t0 = time.monotonic()
    proc = runs.start()
    wait_for(f"run {runs.n} to reach {hold.name} #{hold.nth}\n{runs.log(runs.n) if proc.poll() else ''}",
             hold.reached.is_set, timeout=240, every=0.02)
    reached = time.monotonic() - t0
    kill9(proc)
    hold.release.set()
    return reached, time.monotonic()


@pytest.mark.slow
def test_trainer_killed_at_each_moment_of_a_step(llm_server: LLMTestServer, tmp_path: Path) -> None:
    db = tmp_path / "trainer.db"
    store = TraceStore(f"sqlite:///{db}")
    _rollouts(llm_server, store)
    ckpt = tmp_path / "ckpt"
    model = _model(tmp_path / "model")
    with VLLMStandIn() as srv:
        runs = Runs(f"sqlite:///{db}", model, ckpt, srv.url, tmp_path)
        # 1. mid-step: killed once it holds its batch (claimed, not committed), before any checkpoint.
        srv.hold = Hold("rpc:lightning_checksum", 1)  # backstop: a fast step waits at the publish
        proc = runs.start()
        wait_for("run 1 to claim a batch", lambda: _claimed(db) > 0, timeout=240, every=0.002)
        kill9(proc)
        killed = time.monotonic()
        saved_before_kill = (ckpt / "v000001").exists()
        assert store.train_steps() == [] and srv.swaps == []
        srv.hold.release.set()
        # 2. after saving, before publishing: killed as the publish's first call arrives.
        n = srv.count("rpc:lightning_checksum")
        _, killed2 = _hold_and_kill(runs, srv, Hold("rpc:lightning_checksum", n + 1))
        # Recovery: from a kill until the next run is back where the killed one was (or has committed).
        recovery = {"mid-step": killed2 - killed}
        assert (ckpt / "v000001").is_dir() and srv.swaps == [] and store.train_steps() == []
        # 3. after publishing, before committing: the publish's last call (the checksum after the swap).
        n = srv.count("rpc:lightning_checksum")
        _, killed3 = _hold_and_kill(runs, srv, Hold("rpc:lightning_checksum", n + 2))
        recovery["after save"] = killed3 - killed2
        assert srv.version == "1" and store.train_steps() == []  # served ahead of the store
        # 4. the restart trains everything; the server must first be put back to the committed weights.
        srv.hold = None
        final = runs.start("--max-steps", str(STEPS))
        wait_for("the restart to commit a step", lambda: store.train_steps(), timeout=240)
        recovery["after publish"] = time.monotonic() - killed3
        assert final.wait(300) == 0, runs.log(runs.n)
    steps = store.train_steps()
    trained = [rid for s in steps for rid in s.rollout_ids]
    twice = len(trained) - len(set(trained))
    assert twice == 0 and len(trained) == TASKS * GROUP
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    assert [s.policy_version for s in steps] == list(range(1, STEPS + 1))
    assert store.query_rollouts(consumed=False) == []
    latest = store.latest_policy_version()
    pv = store.get_policy_version(latest)
    assert srv.version == str(latest) == str(STEPS)  # the served version and the store agree
    assert srv.loaded == str(Path(pv.path).resolve())
    # the restart after kill 3 republished the committed weights (the base) before training on
    assert srv.swaps.index((str(model.resolve()), "0")) == 1, srv.swaps  # right after kill 3's swap
    for cell, rec in recovery.items():
        report(Cell(f"trainer killed {cell}", sent=TASKS * GROUP, recorded=len(set(trained)), lost=0,
                    trained_twice=twice, recovery_s=round(rec, 2),
                    note=NOTES[cell] + (" (the step had saved its checkpoint when killed)"
                                        if cell == "mid-step" and saved_before_kill else "")))
    store.close()
