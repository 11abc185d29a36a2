"""Rollout controller on a real (local) Ray runtime: one Ray session for the module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.controller import RayBackend, RetryPolicy, RolloutController
from lightning_middleware.testing import LLMTestServer
from tests.controller import controller_agents as A

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Any:
    root = str(Path(__file__).resolve().parents[2])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    yield
    ray.shutdown()


@pytest.fixture
def sq(tmp_path: Path) -> TraceStore:
    s = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    yield s
    s.close()


def test_ray_groups_concurrency_timeout_and_crash(llm_server: LLMTestServer, sq: TraceStore,
                                                 slowness: float) -> None:
    # The rollouts that must finish run under a timeout they never reach (a short one shared with t4,
    # 5 s at slowness 1 up to 15 s at its cap, cut them short under load in the whole suite); t4, which
    # sleeps four timeouts, then gets a run of its own on the same actors under the short one.
    timeout = 5.0 * slowness
    tasks = A.make_tasks(llm_server, sq, 6, sleep=0.05)
    tasks[4] = {**tasks[4], "sleep": 4 * timeout}
    tasks[5] = {**tasks[5], "crash": True}
    with RolloutController(A.async_tool_agent, store=sq, backend=RayBackend(num_workers=2), concurrency=4,
                           timeout_s=A.UNREACHED_TIMEOUT_S) as c:
        results = c.run(tasks[:4] + tasks[5:], n=3)
        c.timeout_s = timeout
        results += c.run(tasks[4:5], n=3)
    by_task: dict[str, list[Any]] = {}
    for r in results:
        by_task.setdefault(r.task_id, []).append(r)
    assert all(len(v) == 3 for v in by_task.values()) and len(by_task) == 6
    fine = [(r.task_id, r.status, r.reward, r.error) for t in ("t0", "t1", "t2", "t3") for r in by_task[t]]
    assert all(status == "succeeded" and reward == 1.0 for _, status, reward, _ in fine), fine
    assert all(r.status == "timeout" and sq.get_rollout(r.rollout_id).status == "timeout" for r in by_task["t4"])
    assert all(r.status == "failed" and r.attempts == 1 and "tool exploded" in r.error for r in by_task["t5"])
    assert all(len(sq.calls(r.rollout_id)) == 1 for r in by_task["t4"] + by_task["t5"])  # spans kept
    assert c.stats.max_in_flight == 4 and A.max_overlap(sq.query_rollouts()) <= 4


def test_ray_sync_agent_and_killed_actor(llm_server: LLMTestServer, sq: TraceStore, tmp_path: Path) -> None:
    pidfile = str(tmp_path / "pid")
    tasks = A.make_tasks(llm_server, sq, 3)
    tasks[0]["pidfile"] = pidfile

    k = A.Killer(pidfile)
    with RolloutController(A.tool_agent, store=sq, backend="ray", workers=2, concurrency=2,
                           retry=RetryPolicy(backoff_s=0.5, max_attempts=4)) as c:
        results = c.run(tasks, n=2)
    k.join()
    assert k.killed is not None, "no agent announced its pid: nothing was killed"
    failed = [r for r in sq.query_rollouts() if r.status == "failed"]
    assert failed and all("WorkerLost" in r.error for r in failed)
    killed = [r for r in failed if r.task_id == "t0"]
    assert killed and len(sq.calls(killed[0].id)) == 1  # the span it flushed before the kill
    assert all(r.status == "succeeded" for r in results) and len(results) == 6
    assert sq.query_rollouts(status="running") == []
