"""Cancelling a run returns only after every rollout it started has ended (controller/settling.py),
and Ctrl-C is such a cancellation."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.controller.settling import cancel_and_wait, finish_despite_cancellation, gather_settled
from lightning_middleware.testing import LLMTestServer


async def _child(ended: list[str], name: str, cleanup_s: float) -> str:
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(cleanup_s)  # the end being written, as a cancelled rollout's row is
        ended.append(name)
        raise
    return name


@pytest.mark.parametrize("settled", [True, False])
def test_a_cancelled_gather_returns_after_every_child_ended(settled: bool) -> None:
    async def main() -> list[str]:
        ended: list[str] = []
        children = [_child(ended, "quick", 0.0), _child(ended, "slow", 0.2)]
        run = asyncio.ensure_future(gather_settled(children) if settled else asyncio.gather(*children))
        await asyncio.sleep(0.05)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        seen = list(ended)
        await asyncio.sleep(0.3)  # let asyncio.gather's orphan finish before the loop closes
        return seen

    seen = asyncio.run(main())
    # asyncio.gather raises when its first child ended: the contrast that shows the test can fail
    assert seen == (["quick", "slow"] if settled else ["quick"])


def test_a_childs_error_cancels_and_awaits_the_others() -> None:
    async def boom() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("boom")

    async def main() -> list[str]:
        ended: list[str] = []
        with pytest.raises(ValueError, match="boom"):
            await gather_settled([boom(), _child(ended, "other", 0.05)])
        return ended

    assert asyncio.run(main()) == ["other"]


def test_a_write_finishes_though_cancelled_twice() -> None:
    async def main() -> tuple[list[str], bool]:
        done: list[str] = []

        async def write() -> str:
            await asyncio.sleep(0.1)
            done.append("row")
            return "ok"

        async def canceller(waiter: asyncio.Future[str]) -> None:
            for _ in range(2):
                await asyncio.sleep(0.02)
                waiter.cancel()

        waiter = asyncio.ensure_future(finish_despite_cancellation(write()))
        await canceller(waiter)
        result = await waiter
        await cancel_and_wait([])  # nothing pending: returns at once
        return done, result == "ok"

    assert asyncio.run(main()) == (["row"], True)


ROOT = Path(__file__).resolve().parents[2]
INTERRUPTED_RUN = """
import signal, sys, types
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it: a background job of a
# non-interactive shell ignores SIGINT, and Python keeps that
from lightning_middleware import TraceStore
from lightning_middleware.controller import RolloutController
from tests.controller import controller_agents as A
store = TraceStore(sys.argv[1])
with RolloutController(A.tool_agent, store=store, concurrency=4) as c:
    c.run(A.make_tasks(types.SimpleNamespace(base_url=sys.argv[2]), store, 4))
"""


def test_ctrl_c_ends_every_started_rollout_as_cancelled_and_the_process_at_once(tmp_path: Path) -> None:
    """A run of sync agents (threads) waiting on an LLM that answers in 120 s: Ctrl-C records each
    rollout as cancelled (it used to leave the loop with them pending, and their threads later
    recorded them as succeeded), and the process exits without waiting for the agents' calls."""
    url = f"sqlite:///{tmp_path}/traces.db"
    store = TraceStore(url)
    with LLMTestServer(latency_ms=120_000) as slow:
        proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_RUN, url, slow.base_url], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while len(store.query_rollouts(status="running")) < 4:  # each waits on its first call
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the rollouts never started"
                time.sleep(0.1)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=90)
            waited = time.monotonic() - t0
        finally:
            proc.kill()
    assert waited < 90 and proc.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]
    rollouts = store.query_rollouts()
    assert [(r.status.value, r.error) for r in rollouts] == [("failed", "cancelled by the controller")] * 4
