"""Rollout controller on the local backends (asyncio, thread, process) and evaluation metrics."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_middleware import LLMCall, PolicyVersion, Rollout, TraceStore
from lightning_middleware.controller import (
    EarlyStopping,
    Evaluator,
    RetryPolicy,
    RolloutController,
    compute_metrics,
    load_tasks,
    reap_stale,
    reward_smoothness,
)
from lightning_middleware.controller.tasks import TaskFileError, task_timeout
from lightning_middleware.store import get_store
from lightning_middleware.testing import LLMTestServer
from tests.controller import controller_agents as A


@pytest.fixture
def sq(tmp_path: Path) -> TraceStore:
    s = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    yield s
    s.close()


async def test_async_groups_complete_and_concurrency_is_respected(llm_server: LLMTestServer, sq: TraceStore) -> None:
    c = RolloutController(A.async_tool_agent, store=sq, concurrency=3)
    assert c.backend.name == "asyncio"
    results = await c.arun(A.make_tasks(llm_server, sq, 5, sleep=0.02), n=4)
    assert len(results) == 20 and all(r.status == "succeeded" and r.reward == 1.0 for r in results)
    groups = sq.rollout_groups()
    assert sorted(groups) == [f"t{i}" for i in range(5)]
    assert all(len(g) == 4 and {r.metadata["sample_index"] for r in g} == {0, 1, 2, 3} for g in groups.values())
    assert all(len(sq.calls(r.id)) == 2 for g in groups.values() for r in g)
    assert c.stats.max_in_flight == 3 and A.max_overlap(sq.query_rollouts()) <= 3
    assert sq.count("rollout_leases") == 0  # released at the end


def test_thread_backend_jsonl_tasks(llm_server: LLMTestServer, sq: TraceStore, tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({**t, "task_id": None, "id": f"job-{i}"}) + "\n"
                            for i, t in enumerate(A.make_tasks(llm_server, sq, 4, sleep=0.05))))
    with RolloutController(A.tool_agent, store=sq, concurrency=2) as c:
        assert c.backend.name == "thread"
        results = c.run(str(path), n=2)
    assert [r.task_id for r in results] == ["job-0", "job-0", "job-1", "job-1", "job-2", "job-2", "job-3", "job-3"]
    assert all(r.status == "succeeded" for r in results)
    assert A.max_overlap(sq.query_rollouts()) == 2 and c.stats.max_in_flight == 2


def test_load_tasks_sources(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"id": "a", "q": 1}, {"id": "b", "q": 2}])
    assert [t for t, _ in load_tasks(ds)] == ["a", "b"]
    assert [t for t, _ in load_tasks([{"q": 1}, {"q": 2}])] == ["task-0", "task-1"]
    with pytest.raises(ValueError, match="duplicate"):
        load_tasks([{"id": "x"}, {"id": "x"}])
    # a task's own timeout: checked where the controller reads one, ignored elsewhere
    assert load_tasks([{"id": "a", "timeout_s": 2}, {"id": "b", "timeout_s": None}], timeout_key="timeout_s")
    for bad in ("soon", 0, -1.5, True, float("nan"), float("inf"), [3]):
        with pytest.raises(TaskFileError, match=r"^task 'b': timeout_s must be a positive number of seconds, got "):
            load_tasks([{"id": "a", "timeout_s": 2.5}, {"id": "b", "timeout_s": bad}], timeout_key="timeout_s")
    assert load_tasks([{"id": "b", "timeout_s": "soon"}]) == [("b", {"id": "b", "timeout_s": "soon"})]
    assert task_timeout({"timeout_s": 2}, "timeout_s", 9.0) == 2.0 and task_timeout({}, "timeout_s", 9.0) == 9.0
    assert task_timeout({"timeout_s": 2}, None, None) is None


def test_a_bad_task_timeout_stops_the_run_before_any_rollout(llm_server: LLMTestServer, sq: TraceStore) -> None:
    tasks = A.make_tasks(llm_server, sq, 3)
    tasks[2]["timeout_s"] = "30 s"
    with RolloutController(A.tool_agent, store=sq, concurrency=3, timeout_s=A.UNREACHED_TIMEOUT_S) as c:
        with pytest.raises(TaskFileError, match="timeout_s must be a positive number"):
            c.run(tasks)
        assert sq.query_rollouts() == []
        [ok] = c.run(tasks[:1])  # the controller is still usable
    assert ok.status == "succeeded"
    # a controller whose tasks may not set their timeout leaves the key to the agent
    with RolloutController(A.tool_agent, store=sq, concurrency=3, timeout_s=A.UNREACHED_TIMEOUT_S,
                           timeout_key=None) as c:
        assert all(r.status == "succeeded" for r in c.run(tasks[2:]))


async def test_timeout_and_crash_end_rollouts(llm_server: LLMTestServer, sq: TraceStore) -> None:
    base = A.make_tasks(llm_server, sq, 3)
    base[0].update(sleep=120.0, timeout_s=3.0)  # its own timeout, far from its 120 s of sleep
    base[1]["crash"] = True
    # The crash and the plain rollout, beside it, run under a timeout they never reach (at a shared
    # 0.5 s the crash once ran out of time first).
    c = RolloutController(A.async_tool_agent, store=sq, concurrency=3, timeout_s=A.UNREACHED_TIMEOUT_S)
    t0 = time.monotonic()
    slow, crash, ok = await c.arun(base)
    assert time.monotonic() - t0 < 60
    assert slow.status == "timeout" and "3s timeout" in slow.error and slow.attempts == 1
    assert crash.status == "failed" and crash.error == "ValueError: tool exploded" and crash.attempts == 1
    assert ok.status == "succeeded"
    for res, status, ncalls in ((slow, "timeout", 1), (crash, "failed", 1), (ok, "succeeded", 2)):
        stored = sq.get_rollout(res.rollout_id)
        assert stored.status == status and len(sq.calls(res.rollout_id)) == ncalls  # spans kept


def test_thread_timeout_is_recorded_even_though_the_thread_runs_on(llm_server: LLMTestServer,
                                                                   sq: TraceStore) -> None:
    with RolloutController(A.tool_agent, store=sq, concurrency=2, timeout_s=0.3) as c:
        [res] = c.run(A.make_tasks(llm_server, sq, 1, sleep=1.0))
        assert res.status == "timeout"
        assert sq.get_rollout(res.rollout_id).status == "timeout"
        assert c.backend.wait_idle(30)  # the abandoned thread finishes; its late end must not say "succeeded"
        sq.flush()
        assert sq.get_rollout(res.rollout_id).status == "timeout"


def test_the_thread_backends_pool_runs_jobs_on_at_most_its_daemon_threads() -> None:
    """DaemonThreadPool: results and errors reach the futures, at most max_workers threads, all
    daemons (an abandoned agent call does not hold the interpreter's exit), idle ones reused, and
    shutdown cancels what has not started."""
    from lightning_middleware.controller.backends.local import DaemonThreadPool

    prefix = "daemon-pool-test"
    pool = DaemonThreadPool(2, thread_name_prefix=prefix)
    release = threading.Event()
    names: list[str] = []

    def job(i: int) -> int:
        names.append(threading.current_thread().name)
        assert threading.current_thread().daemon
        release.wait(30)
        if i == 3:
            raise ValueError("three")
        return i * 10

    def until(condition: Any) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def threads() -> int:
        return sum(t.name.startswith(prefix) for t in threading.enumerate())

    futures = [pool.submit(job, i) for i in range(5)]
    until(lambda: len(names) == 2)
    time.sleep(0.2)
    assert sum(f.running() for f in futures) == 2 and len(names) == 2 and threads() == 2  # the rest queued
    release.set()
    assert [f.result(30) for f in futures[:3]] == [0, 10, 20]
    with pytest.raises(ValueError, match="three"):
        futures[3].result(30)
    assert futures[4].result(30) == 40 and set(names) == {f"{prefix}_0", f"{prefix}_1"}
    assert pool.submit(lambda: "again").result(30) == "again" and threads() == 2  # idle threads reused
    release.clear()
    busy = [pool.submit(job, 0) for _ in range(2)]
    until(lambda: all(f.running() for f in busy))
    waiting = pool.submit(job, 0)
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled() and not any(f.cancelled() for f in busy)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(job, 0)
    release.set()
    assert [f.result(30) for f in busy] == [0, 0]
    until(lambda: threads() == 0)  # told to stop once their jobs ended


def test_infra_errors_retry_low_rewards_do_not(llm_server: LLMTestServer, sq: TraceStore) -> None:
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def flaky(task: dict[str, Any]) -> float:
        with lock:
            seen[task["task_id"]] = k = seen.get(task["task_id"], 0) + 1
        A.tool_agent({**task, "reward": 0.0})
        if task["task_id"] == "t0" and k == 1:
            raise ConnectionResetError("engine restarted")
        if task["task_id"].startswith("t1"):
            raise KeyError("custom infra")
        return 0.0  # a bad answer: never retried

    with RolloutController(flaky, store=sq, concurrency=2,
                           retry=RetryPolicy(max_attempts=3, retry_on=(ConnectionError, KeyError),
                                             backoff_s=0.01)) as c:
        r0, r1, r2 = c.run(A.make_tasks(llm_server, sq, 3))
    assert (r0.status, r0.attempts, r0.reward) == ("succeeded", 2, 0.0)
    first = sq.get_rollout(r0.rollout_ids[0])
    assert first.status == "failed" and "ConnectionResetError" in first.error and len(sq.calls(first.id)) == 2
    assert sq.get_rollout(r0.rollout_id).metadata["retry_of"] == first.id
    assert (r1.status, r1.attempts, len(r1.rollout_ids)) == ("failed", 3, 3)
    assert (r2.status, r2.attempts, r2.reward) == ("succeeded", 1, 0.0)
    assert c.stats.retried == 3 and seen == {"t0": 2, "t1": 3, "t2": 1}
    # Not configured: not retried.
    with RolloutController(flaky, store=sq, retry=RetryPolicy(max_attempts=3)) as c2:
        [r] = c2.run([{**A.make_tasks(llm_server, sq, 2)[1], "task_id": "t1b"}])
    assert r.attempts == 1 and r.status == "failed"


def test_pause_drain_resume(llm_server: LLMTestServer, sq: TraceStore) -> None:
    c = RolloutController(A.tool_agent, store=sq, concurrency=2)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.extend(c.run(A.make_tasks(llm_server, sq, 8, sleep=0.15))))
    t.start()
    deadline = time.monotonic() + 30
    while c.stats.started < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.drain(timeout=10) and c.in_flight == 0 and c.paused
    started = c.stats.started
    assert 2 <= started < 8
    held = c.stats.held_by_pause
    deadline = time.monotonic() + 30
    while c.stats.held_by_pause < held + 10 and time.monotonic() < deadline:  # queued rollouts were held 10 times
        time.sleep(0.01)
    assert c.stats.held_by_pause >= held + 10
    assert c.stats.started == started and c.in_flight == 0  # nothing new while paused
    assert all(r.status != "running" for r in sq.query_rollouts())
    c.resume()
    t.join(20)
    assert len(out) == 8 and all(r.status == "succeeded" for r in out)
    c.close()


def test_process_backend_killed_worker_and_hard_timeout(llm_server: LLMTestServer, sq: TraceStore,
                                                        tmp_path: Path) -> None:
    pidfile = str(tmp_path / "pid")
    tasks = A.make_tasks(llm_server, sq, 3)
    tasks[0]["pidfile"] = pidfile  # first attempt announces its pid and hangs: we kill -9 it
    tasks[1]["sleep"] = 30  # SIGALRM timeout inside the worker

    k = A.Killer(pidfile)
    tasks[1]["timeout_s"] = 4  # its own: the worker's alarm cuts it at 4 s
    # The killed task's retry and the plain one run under a timeout they never reach (a timeout
    # shared by all three is a load flake).
    with RolloutController(A.tool_agent, store=sq, backend="process", workers=3, concurrency=3,
                           timeout_s=A.UNREACHED_TIMEOUT_S, retry=RetryPolicy(backoff_s=0.01)) as c:
        killed, slow, ok = c.run(tasks)
    k.join()
    assert k.killed is not None, "no agent announced its pid: nothing was killed"
    first = sq.get_rollout(killed.rollout_ids[0])
    assert first.status == "failed" and "WorkerLost" in first.error and "exit code -9" in first.error
    assert len(sq.calls(first.id)) == 1  # the span it made before it died
    assert killed.status == "succeeded" and killed.attempts == 2  # a lost worker is an infra error: retried
    assert slow.status == "timeout" and sq.get_rollout(slow.rollout_id).status == "timeout"
    assert len(sq.calls(slow.rollout_id)) == 1
    assert ok.status == "succeeded" and len(sq.calls(ok.rollout_id)) == 2
    assert sq.query_rollouts(status="running") == []


def test_a_worker_lost_after_its_rollout_succeeded_keeps_the_rollout(llm_server: LLMTestServer,
                                                                     sq: TraceStore) -> None:
    """The store's succeeded rollout is the outcome: a retry would sample the task twice."""
    [task] = A.make_tasks(llm_server, sq, 1)
    with RolloutController(A.dies_before_reporting, store=sq, backend="process", workers=1,
                           retry=RetryPolicy(backoff_s=0.01)) as c:
        [res] = c.run([task])
    assert (res.status, res.attempts, res.reward) == ("succeeded", 1, 1.0)
    assert [r.status.value for r in sq.query_rollouts()] == ["succeeded"]
    assert c.stats.retried == 0


def test_continuous_mode_tags_policy_versions(llm_server: LLMTestServer, sq: TraceStore) -> None:
    sq.add_policy_version(PolicyVersion(version=1))
    c = RolloutController(A.async_tool_agent, store=sq, concurrency=4, policy_version_ttl_s=0.0)
    groups: list[list[Any]] = []
    in_flight_groups: list[int] = []

    def on_group(results: list[Any]) -> None:
        groups.append(results)
        in_flight_groups.append(c.stats.groups_started - c.stats.groups_finished)
        if len(groups) == 3:
            sq.add_policy_version(PolicyVersion(version=2))

    t = c.start_continuous(A.make_tasks(llm_server, sq, 3, sleep=0.02), n=2, groups_in_flight=2, max_groups=8,
                           on_group=on_group)
    t.join(30)
    assert len(groups) == 8 and all(len(g) == 2 and len({r.task_id for r in g}) == 1 for g in groups)
    assert max(in_flight_groups) <= 2 and c.stats.max_in_flight <= 4
    versions = [r.policy_version for r in sq.query_rollouts()]
    assert versions[:6] == [1] * 6 and versions[-1] == 2 and sorted(versions) == versions
    assert {r.policy_version for r in sq.query_rollouts()} == {1, 2}
    # stop() ends an unbounded run
    started = c.stats.started
    t2 = c.start_continuous(A.make_tasks(llm_server, sq, 3), n=1, groups_in_flight=1)
    deadline = time.monotonic() + 30
    while c.stats.started <= started and time.monotonic() < deadline:  # it runs
        time.sleep(0.01)
    c.stop()
    t2.join(10)
    assert not t2.is_alive()


def test_leases_and_reap_stale(store: TraceStore) -> None:
    now = time.time()
    for rid in ("dead", "alive", "unleased", "done"):
        store.create_rollout(Rollout(id=rid, task_id="t", created_at=now - 100))
    store.finish_rollout("done")
    store.heartbeat(["dead", "done"], owner="ctl", at=now - 60)
    store.heartbeat(["alive"], owner="ctl", at=now - 60)
    store.heartbeat(["alive"], owner="ctl")  # refreshed
    beats = store.lease_heartbeats(["dead", "alive", "unleased"])  # what `lightning-mw k8s reap` reads
    assert sorted(beats) == ["alive", "dead"] and beats["dead"] == pytest.approx(now - 60) and beats["alive"] >= now
    assert store.lease_heartbeats([]) == {}
    assert reap_stale(store, 30) == ["dead"]
    dead = store.get_rollout("dead")
    assert dead.status == "failed" and "lease expired" in dead.error and dead.duration_s == pytest.approx(100, abs=5)
    assert store.get_rollout("alive").status == "running" and store.get_rollout("done").status == "succeeded"
    assert store.reap_stale(30, include_unleased=True) == ["unleased"]
    # a rollout whose row never reached the store is inserted already ended
    assert store.end_rollout_if_running(Rollout(id="ghost", task_id="t", created_at=now - 1),
                                        status="failed", error="WorkerLost: gone")
    assert store.get_rollout("ghost").status == "failed"
    assert not store.end_rollout_if_running(Rollout(id="done", task_id="t"), status="failed", error="x")
    store.release_leases(["alive", "dead", "done"])
    assert store.count("rollout_leases") == 0
    # the first end stands: a worker reporting late (a deleted pod flushing its buffer) does not
    # overwrite the lease reaper's or the controller's verdict
    store.submit_rollout_end("dead", status="succeeded", ended_at=time.time(), duration_s=1.0, error=None)
    store.submit_rollout_end("alive", status="succeeded", ended_at=time.time(), duration_s=1.0, error=None)
    assert store.flush(10)
    assert store.get_rollout("dead").status == "failed" and "lease expired" in store.get_rollout("dead").error
    assert store.get_rollout("alive").status == "succeeded"


def _call(rid: str, idx: int, *, agent: str | None, prompt: int, completion: int, tools: list[str] | None = None,
          tool_calls: list[tuple[str, str]] | None = None, attempt: int = 1, training: bool = True) -> LLMCall:
    request: dict[str, Any] = {"messages": []}
    if tools is not None:
        request["tools"] = [{"type": "function", "function": {"name": n}} for n in tools]
    message: dict[str, Any] = {"role": "assistant", "content": "x"}
    if tool_calls:
        message["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(tool_calls)]
    return LLMCall(id=f"{rid}-{idx}-{attempt}", rollout_id=rid, call_index=idx, attempt=attempt, agent_name=agent,
                   request=request, response={"choices": [{"message": message}]},
                   prompt_token_ids=tuple(range(prompt)), completion_token_ids=tuple(range(completion)),
                   is_training=training, started_at=time.time())


def test_eval_metrics_on_a_constructed_case(store: TraceStore) -> None:
    # task A: r1 reward 1.0 (succeeded), r2 reward 0.5; task B: r3 failed (no reward).
    for rid, task, status in (("r1", "A", "succeeded"), ("r2", "A", "succeeded"), ("r3", "B", "failed")):
        store.create_rollout(Rollout(id=rid, task_id=task, mode="val", created_at=time.time()))
        store.finish_rollout(rid, status=status)
    from lightning_middleware.records import Reward
    store.add_reward(Reward(rollout_id="r1", value=1.0))
    store.add_reward(Reward(rollout_id="r2", value=0.5))
    calls = [
        # r1: planner call with 2 tool calls (1 valid, 1 bad JSON), a failed attempt then the real one;
        _call("r1", 0, agent="planner", prompt=10, completion=5, tools=["search"], attempt=1, training=False),
        _call("r1", 0, agent="planner", prompt=10, completion=5, tools=["search"], attempt=2,
              tool_calls=[("search", '{"q": 1}'), ("search", "{bad")]),
        _call("r1", 1, agent="solver", prompt=20, completion=4),
        # r2: planner call with an unknown tool, solver call with a valid one
        _call("r2", 0, agent="planner", prompt=8, completion=2, tools=["search"], tool_calls=[("browse", "{}")]),
        _call("r2", 1, agent="solver", prompt=12, completion=3, tools=["calc"], tool_calls=[("calc", "[1, 2]")]),
        _call("r2", 2, agent="solver", prompt=30, completion=1),
        # r3: one unnamed call
        _call("r3", 0, agent=None, prompt=6, completion=0),
    ]
    for call in calls:
        store.record_call(call)
    m = compute_metrics(store, ["r1", "r2", "r3"], success_threshold=1.0)
    assert m["rollouts"] == 3 and m["tasks"] == 2 and m["statuses"] == {"failed": 1, "succeeded": 2}
    assert m["success_rate"] == pytest.approx(1 / 3)  # only r1 reaches 1.0
    assert m["task_success_rate"] == pytest.approx(1 / 2)  # A has a success, B none
    assert m["completion_rate"] == pytest.approx(2 / 3)
    assert m["mean_reward"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert m["avg_turns"] == pytest.approx((2 + 3 + 1) / 3)  # attempts are not turns
    assert m["tool_calls"] == 4 and m["tool_call_accuracy"] == pytest.approx(2 / 4)
    assert m["tokens_per_rollout"] == pytest.approx(((15 + 24) + (10 + 15 + 31) + 6) / 3)
    assert m["completion_tokens_per_rollout"] == pytest.approx((9 + 6 + 0) / 3)
    pa = m["per_agent"]
    assert set(pa) == {"planner", "solver", "(unnamed)"}
    assert pa["planner"] == {"rollouts": 2, "calls": 2, "turns_per_rollout": 1.0, "tokens_per_rollout": 12.5,
                             "tool_calls": 3, "tool_call_accuracy": pytest.approx(1 / 3), "mean_reward": 0.75}
    assert pa["solver"]["calls"] == 3 and pa["solver"]["turns_per_rollout"] == 1.5
    assert pa["solver"]["tool_call_accuracy"] == 1.0 and pa["solver"]["mean_reward"] == 0.75
    assert pa["(unnamed)"]["mean_reward"] == 0.0 and pa["(unnamed)"]["tool_call_accuracy"] is None

    # History: smoothness and early stopping over stored evaluations.
    assert reward_smoothness([0.2, 0.5]) is None
    assert reward_smoothness([0.2, 0.5, 0.4]) == pytest.approx(0.2)  # diffs 0.3, -0.1
    ev = Evaluator(lambda task: 1.0, [{"id": "A"}], store=store, early_stopping=EarlyStopping(patience=2))
    results = [ev.record(ids) for ids in (["r1"], ["r2"], ["r1", "r2"], ["r3"])]  # mean 1.0, 0.5, 0.75, 0.0
    assert [r.metrics["mean_reward"] for r in results] == [1.0, 0.5, 0.75, 0.0]
    assert results[2].metrics["reward_smoothness"] == pytest.approx(0.375)  # diffs -0.5, +0.25
    assert [r.metrics["early_stop"]["stop"] for r in results] == [False, False, True, True]
    assert ev.should_stop
    stored = store.eval_results("val")
    assert [e.metrics["mean_reward"] for e in stored] == [1.0, 0.5, 0.75, 0.0] and stored[0].rollout_ids == ("r1",)
    ev.close()


async def test_evaluator_runs_val_rollouts(llm_server: LLMTestServer, sq: TraceStore) -> None:
    c = RolloutController(A.async_tool_agent, store=sq, concurrency=4)
    tasks = A.make_tasks(llm_server, sq, 3)
    tasks[2]["reward"] = 0.0
    ev = Evaluator(c, tasks, n=2, every_n_steps=5)
    assert ev.due(10) and not ev.due(3)
    res = await ev.aevaluate(step=10)
    assert len(res.rollout_ids) == 6 and all(sq.get_rollout(i).mode == "val" for i in res.rollout_ids)
    m = res.metrics
    assert m["success_rate"] == pytest.approx(4 / 6) and m["mean_reward"] == pytest.approx(4 / 6)
    assert m["avg_turns"] == 2.0 and m["tool_calls"] == 6 and m["tool_call_accuracy"] == 1.0
    assert sq.eval_results()[0].step == 10


def test_cli_run_and_metrics(llm_server: LLMTestServer, sq: TraceStore, tmp_path: Path, capsys: Any) -> None:
    from lightning_middleware.cli import main

    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in A.make_tasks(llm_server, sq, 2)))
    url = sq.url.render_as_string(hide_password=False)
    assert main(["rollouts", "run", "--agent", "tests.controller.controller_agents:tool_agent", "--tasks", str(path),
                 "-n", "2", "--store", url, "--concurrency", "2"]) == 0
    assert "4 rollouts" in capsys.readouterr().out
    assert main(["rollouts", "eval", "--agent", "tests.controller.controller_agents:async_tool_agent",
                 "--tasks", str(path), "--store", url, "--step", "3"]) == 0
    assert "success_rate" in capsys.readouterr().out
    assert main(["rollouts", "metrics", "--store", url]) == 0
    assert main(["rollouts", "reap", "--store", url, "--older-than", "60"]) == 0
    assert "ended 0" in capsys.readouterr().out
    get_store(url).close()  # the one run and eval shared, as a process's wrapped clients do (a CLI's ends with it)


def test_an_outcomes_breach_class_is_read_from_its_error_types() -> None:
    """`jobs.breach_in`: the class a breach outcome's error types name; none for other errors, and
    a breach is never retried, whatever the policy names."""
    from lightning_middleware.controller.jobs import BREACHES, SandboxBreach, breach_in, type_names

    for breach in BREACHES.values():
        assert breach_in(type_names(breach)) is breach
        assert not RetryPolicy(retry_on=("Exception", "builtins.BaseException")).matches(type_names(breach))
    assert breach_in(type_names(ConnectionRefusedError)) is None and breach_in(()) is None
    assert breach_in(type_names(SandboxBreach)) is None  # the base names no class


def _scripted_rewards() -> tuple[Any, list[str]]:
    """An agent whose reward is fixed by its task: `solved` 1, `never` 0, `mixed` 1 then 0 by turns
    (every group of 2 has signal), `half` fails one sample of each group (one reward: not uniform)."""
    started: list[str] = []
    turns: dict[str, int] = {}

    async def agent(task: dict[str, Any]) -> float:
        tid = task["task_id"]
        turns[tid] = turns.get(tid, 0) + 1
        if turns[tid] % 2 == 1:
            started.append(tid)
        if tid == "half" and turns[tid] % 2 == 0:
            raise ValueError("the agent's own bug: failed, not retried")
        return {"solved": 1.0, "never": 0.0, "mixed": float(turns[tid] % 2), "half": 1.0}[tid]

    return agent, started


def test_continuous_mode_lets_tasks_whose_last_group_was_uniform_sit_out(sq: TraceStore) -> None:
    tasks = [{"task_id": t} for t in ("solved", "never", "mixed", "half")]
    agent, started = _scripted_rewards()
    with RolloutController(agent, store=sq, concurrency=2) as c:
        stats = c.run_continuous(tasks, n=2, groups_in_flight=1, max_groups=8, sit_out_uniform=1.0)
    # epoch 0 samples all four; after it, the two uniform tasks sit out every turn
    assert started == ["solved", "never", "mixed", "half", "mixed", "half", "mixed", "half"]
    assert stats.groups_sat_out_uniform == 4 and stats.groups_finished == 8
    # the default samples every task every epoch, the same order as before the option existed
    agent, started = _scripted_rewards()
    with RolloutController(agent, store=sq, concurrency=2) as c:
        stats = c.run_continuous(tasks, n=2, groups_in_flight=1, max_groups=8)
    assert started == ["solved", "never", "mixed", "half"] * 2 and stats.groups_sat_out_uniform == 0
    with RolloutController(agent, store=sq) as c, pytest.raises(ValueError, match="sit_out_uniform"):
        c.run_continuous(tasks, n=2, sit_out_uniform=1.5)


def test_when_every_task_sits_out_the_next_epoch_samples_them_all(sq: TraceStore) -> None:
    agent, started = _scripted_rewards()
    with RolloutController(agent, store=sq, concurrency=2) as c:
        stats = c.run_continuous([{"task_id": "solved"}, {"task_id": "never"}], n=2, groups_in_flight=1,
                                 max_groups=5, sit_out_uniform=1.0)
    # epochs: 0 runs both, 1 skips both, 2 runs both (none ran in 1), 3 skips both, 4 runs one
    assert started == ["solved", "never"] * 2 + ["solved"] and stats.groups_sat_out_uniform == 4


def test_a_partial_chance_lets_some_uniform_turns_through(sq: TraceStore) -> None:
    agent, started = _scripted_rewards()
    tasks = [{"task_id": "solved"}, {"task_id": "mixed"}]
    with RolloutController(agent, store=sq, concurrency=2) as c:
        stats = c.run_continuous(tasks, n=2, groups_in_flight=1, max_groups=60, sit_out_uniform=0.5, seed=7)
    solved, epochs = started.count("solved"), started.count("mixed") + (started[-1] == "solved")
    # `mixed` runs every epoch; `solved` has a turn each epoch, and sits out about half of them after the first
    assert started.count("mixed") + solved == 60 and stats.groups_sat_out_uniform + solved == epochs
    assert 8 <= stats.groups_sat_out_uniform <= 32 and solved >= 8, (solved, stats.groups_sat_out_uniform)
