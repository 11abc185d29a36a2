"""Several rollouts per Kubernetes Job (`KubernetesBackend(rollouts_per_job=N)`) against the emulated API
server, through the official client over HTTP; the test kubelet runs each Job's pod (the worker
entrypoint, running its batch one rollout after another) as a local process."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.controller import KubernetesBackend, RetryPolicy, RolloutController, RolloutResult
from lightning_middleware.controller.backends.k8s_batch import batch_message, parse_batch_message
from lightning_middleware.controller.backends.k8s_client import api_client, reap_jobs
from lightning_middleware.controller.backends.k8s_template import (
    BATCH_LABEL,
    ROLLOUTS_ANNOTATION,
    PodTemplate,
    batch_manifest,
    jobs_deadline_s,
    run_selector,
)
from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome
from lightning_middleware.testing import LLMTestServer
from lightning_middleware.testing.k8s_api import K8sAPIServer
from lightning_middleware.testing.kubelet import Kubelet
from tests.controller import controller_agents as A
from tests.controller.k8s_fixtures import template

pytest.importorskip("kubernetes")
Cluster = tuple[K8sAPIServer, Kubelet]
AGENT = "tests.controller.controller_agents:tool_agent"


@pytest.fixture
def sq(tmp_path: Path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    yield s
    s.close()


def _backend(api: K8sAPIServer, per_job: int, **kw: Any) -> KubernetesBackend:
    return KubernetesBackend(template(**kw.pop("template", {})), api_url=api.url, rollouts_per_job=per_job, **kw)


def _batches(api: K8sAPIServer, backend: KubernetesBackend) -> list[list[str]]:
    """The rollout ids of each of the run's batch Jobs, in the order its pod runs them (a batch of one
    is a plain one-rollout Job)."""
    return [json.loads(j["metadata"]["annotations"][ROLLOUTS_ANNOTATION])
            for j in api.objects("jobs", run_selector(backend.run_id))
            if ROLLOUTS_ANNOTATION in j["metadata"]["annotations"]]


def _env(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_a_batch_runs_its_rollouts_in_one_pod_with_results_per_rollout(cluster: Cluster, llm_server: LLMTestServer,
                                                                       sq: TraceStore) -> None:
    api, kubelet = cluster
    tasks = A.make_tasks(llm_server, sq, 3)
    for i, t in enumerate(tasks):
        t["reward"] = 0.25 * (i + 1)
    backend = _backend(api, 3, batch_linger_s=0.5)
    with RolloutController(AGENT, store=sq, backend=backend, concurrency=6, timeout_s=60, policy_version=0) as c:
        results = c.run(tasks, n=2)
        jobs = api.objects("jobs", run_selector(backend.run_id))
        group = c.run(tasks[:1], n=3)  # one group, arriving together: one Job
        last = [j for j in api.objects("jobs", run_selector(backend.run_id)) if j not in jobs]
    assert [r.status for r in results] == ["succeeded"] * 6 and all(r.attempts == 1 for r in results)
    assert [r.reward for r in results] == [0.25, 0.25, 0.5, 0.5, 0.75, 0.75]  # each rollout its own reward
    assert all(len(sq.calls(r.rollout_id)) == 2 for r in results + group)
    assert len(jobs) == 2 and kubelet.pods_started == 3 and backend.jobs_created == 3
    assert sorted(i for j in jobs for i in json.loads(j["metadata"]["annotations"][ROLLOUTS_ANNOTATION])) == \
        sorted(r.rollout_id for r in results)
    spec = jobs[0]["spec"]
    assert BATCH_LABEL in jobs[0]["metadata"]["labels"] and "lightning-middleware/rollout" not in \
        jobs[0]["metadata"]["labels"]
    assert spec["activeDeadlineSeconds"] == math.ceil(3 * 60 + 30) and spec["backoffLimit"] == 0
    env = _env(jobs[0])
    assert "LIGHTNING_ROLLOUT_JOB" not in env and len(json.loads(env["LIGHTNING_ROLLOUT_JOBS"])) == 3
    (job,) = last
    assert json.loads(job["metadata"]["annotations"]["lightning-middleware/task-id"]) == ["t0"] * 3
    assert all(r.status == "succeeded" for r in group)
    assert sq.query_rollouts(status="running") == [] and api.objects("jobs") == []  # close() deleted them


def test_a_rollout_that_fails_or_times_out_leaves_its_batch_mates_alone(cluster: Cluster, llm_server: LLMTestServer,
                                                                         sq: TraceStore, slowness: float) -> None:
    api, _ = cluster
    timeout = 8.0 * slowness
    tasks = A.make_tasks(llm_server, sq, 4)
    tasks[1]["crash"] = True  # the agent raised: failed, not retried
    # the worker's alarm ends it at its own timeout and the next one still runs; its batch-mates run
    # under a timeout they never reach (one shared with the sleeper would be a load flake)
    tasks[2].update(sleep=6 * timeout, timeout_s=timeout)
    exits = [{**t, "task_id": f"x{i}"} for i, t in enumerate(A.make_tasks(llm_server, sq, 3))]
    exits[1]["exit_code"] = 3  # the agent's process dies mid-batch
    backend = _backend(api, 4, batch_linger_s=0.5)
    with RolloutController(AGENT, store=sq, backend=backend, concurrency=4, timeout_s=A.UNREACHED_TIMEOUT_S,
                           policy_version=0, retry=RetryPolicy(max_attempts=2, backoff_s=0.05)) as c:
        first = {r.task_id: r for r in c.run(tasks)}
        assert backend.jobs_created == 1
        second = {r.rollout_ids[0]: r for r in c.run(exits)}
        order = [b for b in _batches(api, backend) if set(b) == set(second)][0]
    assert first["t0"].status == first["t3"].status == "succeeded"
    assert first["t1"].status == "failed" and first["t1"].error == "ValueError: tool exploded"
    slow = first["t2"]
    assert slow.status == "timeout" and f"{timeout:g}s timeout" in (slow.error or "")
    assert len(sq.calls(slow.rollout_id)) == 1
    assert all(r.attempts == 1 for r in first.values())
    assert [second[r].task_id for r in order] == ["x0", "x1", "x2"]  # the batch runs in arrival order
    ok, died, after = (second[r] for r in order)
    assert ok.status == "succeeded" and ok.attempts == 1
    assert died.status == "failed" and died.attempts == 1 and "exited with code 3" in (died.error or "")
    assert "agent log line 29" in (died.error or "")
    assert after.status == "succeeded" and after.attempts == 2  # never started: re-queued, ran in a new Job
    cut = sq.get_rollout(after.rollout_ids[0])
    assert cut is not None and cut.status == "failed" and "BatchCutShort" in (cut.error or "")
    assert "never started" in (cut.error or "") and sq.calls(after.rollout_ids[0]) == []
    assert sq.query_rollouts(status="running") == []


@pytest.mark.parametrize("fault", ["evict", "oom", "node_lost"])
def test_a_pod_killed_mid_batch_fails_only_its_unfinished_rollouts(cluster: Cluster, llm_server: LLMTestServer,
                                                                  sq: TraceStore, tmp_path: Path, fault: str) -> None:
    api, kubelet = cluster
    tasks = A.make_tasks(llm_server, sq, 4)
    pidfile = str(tmp_path / "pid")
    tasks[2]["pidfile"] = pidfile  # the third rollout announces its pid after its first call, then waits

    def killer() -> None:
        end = time.monotonic() + 60
        while not os.path.exists(pidfile) and time.monotonic() < end:
            time.sleep(0.02)
        with open(pidfile) as f:
            kubelet.kill_pod(int(f.read()), fault)

    thread = threading.Thread(target=killer)
    thread.start()
    backend = _backend(api, 4, batch_linger_s=0.5)
    with RolloutController(AGENT, store=sq, backend=backend, concurrency=4, timeout_s=60, policy_version=0,
                           retry=RetryPolicy(max_attempts=3, backoff_s=0.05)) as c:
        results: dict[str, RolloutResult] = {r.task_id: r for r in c.run(tasks)}
        order = [b for b in _batches(api, backend) if len(b) == 4][0]
    thread.join(10)
    assert [r.status for r in results.values()] == ["succeeded"] * 4
    assert order == [results[f"t{i}"].rollout_ids[0] for i in range(4)]
    for tid in ("t0", "t1"):  # finished before the kill: reported, not rerun
        assert results[tid].attempts == 1 and len(sq.calls(results[tid].rollout_id)) == 2
    killed = results["t2"]
    first = sq.get_rollout(killed.rollout_ids[0])
    want = {"evict": "PodEvicted: pod", "oom": "PodOOMKilled: pod", "node_lost": "PodNodeLost: pod"}[fault]
    assert killed.attempts == 2 and first is not None and first.status == "failed" and want in (first.error or "")
    assert len(sq.calls(killed.rollout_ids[0])) == 1  # its span so far stays, once
    queued = results["t3"]
    cut = sq.get_rollout(queued.rollout_ids[0])
    assert queued.attempts == 2 and cut is not None and "BatchCutShort" in (cut.error or "")
    assert want.split(":")[0] in (cut.error or "")  # it says why its pod ended
    assert sq.count("llm_calls") == 4 * 2 + 1  # no rollout ran twice
    assert sq.query_rollouts(status="running") == []


def test_cancelling_a_batchs_rollouts_deletes_its_job(cluster: Cluster, llm_server: LLMTestServer,
                                                      sq: TraceStore) -> None:
    api, kubelet = cluster
    # The batch leaves only when full (the linger outlasts the test), so under any load both rollouts
    # share one Job: its pod runs the first and never starts the second.
    backend = _backend(api, 2, batch_linger_s=120)
    c = RolloutController(AGENT, store=sq, backend=backend, concurrency=2, policy_version=0)

    async def cancel_when_running() -> None:
        run = asyncio.ensure_future(c.arun(A.make_tasks(llm_server, sq, 2, sleep=60)))
        end = time.monotonic() + 60
        while not sq.query_rollouts(status="running") and time.monotonic() < end:
            await asyncio.sleep(0.1)
        assert len(api.objects("jobs")) == 1
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert api.objects("jobs") == []  # deleted before the cancellation returned

    try:
        c.run_sync(cancel_when_running())
        ended = sq.query_rollouts()  # the one running and the one its pod never started
        assert len(ended) == 2 and all(r.status == "failed" and "cancelled" in (r.error or "") for r in ended)
        end = time.monotonic() + 30
        while kubelet.active and time.monotonic() < end:
            time.sleep(0.05)
        assert kubelet.active == 0
    finally:
        c.close()


def test_concurrency_counts_rollouts_and_max_jobs_counts_jobs(cluster: Cluster, llm_server: LLMTestServer,
                                                              sq: TraceStore) -> None:
    api, kubelet = cluster
    backend = _backend(api, 2, max_jobs=1, batch_linger_s=0.5)
    with RolloutController(AGENT, store=sq, backend=backend, concurrency=4, policy_version=0) as c:
        results = c.run(A.make_tasks(llm_server, sq, 4, sleep=0.2), n=2)
    assert all(r.status == "succeeded" and r.attempts == 1 for r in results) and len(results) == 8
    assert c.stats.max_in_flight == 4  # rollouts handed to the backend: the controller's limit
    assert kubelet.max_active == 1 and backend.jobs_created == 4  # one Job of 2 at a time
    assert A.max_overlap(sq.query_rollouts()) == 1  # one pod, its rollouts one after another


def test_a_batch_too_large_for_a_pods_env_is_split(cluster: Cluster, llm_server: LLMTestServer,
                                                   sq: TraceStore) -> None:
    api, kubelet = cluster
    tasks = A.make_tasks(llm_server, sq, 4, notes="x" * 40_000)  # 160 KB as one env value: over the limit
    backend = _backend(api, 4, batch_linger_s=0.5)
    with RolloutController(AGENT, store=sq, backend=backend, concurrency=4, policy_version=0) as c:
        results = c.run(tasks)
    assert all(r.status == "succeeded" for r in results) and backend.jobs_created == 2


def test_the_termination_message_fits_and_reads_back() -> None:
    err = RolloutOutcome(status="failed", error="ConnectionError: " + "e" * 3000,
                         error_types=("builtins.ConnectionError", "builtins.OSError", "builtins.Exception"))
    done = {f"{i:032x}": err if i % 2 else RolloutOutcome(status="succeeded", reward=0.5, duration_s=1.23456)
            for i in range(8)}
    text = batch_message(done, ["f" * 32, "e" * 32])
    assert len(text.encode()) <= 4096
    back, running = parse_batch_message(text, "pod-1")
    assert running == ["f" * 32, "e" * 32] and set(back) == set(done)
    assert back[f"{1:032x}"].error_types == err.error_types
    assert (back[f"{1:032x}"].error or "").startswith("ConnectionError: e")
    assert back[f"{0:032x}"] == RolloutOutcome(status="succeeded", reward=0.5, duration_s=1.235, worker="pod-1")
    many = {f"{i:032x}": err for i in range(200)}  # too many to fit: the newest kept, the rest from the store
    back, _ = parse_batch_message(batch_message(many, []), None)
    assert 0 < len(back) < 200 and f"{199:032x}" in back
    assert parse_batch_message("not json", None) == ({}, [])


def test_a_batchs_deadline_is_its_rounds_of_its_longest_own_timeout() -> None:
    template = PodTemplate(image="img", startup_grace_s=30.0)

    def jobs(*timeouts: float | None) -> list[RolloutJob]:
        return [RolloutJob(rollout_id=f"r{i}", task_id="t", task={}, timeout_s=t) for i, t in enumerate(timeouts)]

    assert jobs_deadline_s(template, jobs(10.0)) == 40
    assert jobs_deadline_s(template, jobs(10.0, 2.5, 4.0)) == 60  # three rounds, one at a time
    assert jobs_deadline_s(template, jobs(2.5, 10.0, 4.0), concurrency=2) == 50
    assert jobs_deadline_s(template, jobs(10.0, None)) is None  # one rollout with no timeout: no deadline
    assert batch_manifest(template, jobs(3.0, 12.0), run_id="run1", batch_id="b1", agent_ref="m:f",
                          concurrency=2)["spec"]["activeDeadlineSeconds"] == 54


def test_reap_keeps_a_batch_job_while_any_of_its_rollouts_heartbeats(cluster: Cluster, sq: TraceStore) -> None:
    api, _ = cluster
    from kubernetes.client import BatchV1Api

    client = api_client(api_url=api.url)
    jobs = [RolloutJob(rollout_id=c * 32, task_id="t", task={}, store_url="sqlite://") for c in "abc"]
    BatchV1Api(client).create_namespaced_job("rollouts", batch_manifest(
        template(image="never/pulled:x"), jobs, run_id="dead", batch_id="d" * 32, agent_ref="m:f"))

    def age_jobs() -> None:
        assert api.store is not None
        for (plural, _, _), obj in api.store.objects.items():
            if plural == "jobs":
                obj["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    api.call(age_jobs)
    sq.heartbeat(["b" * 32], owner="alive")  # the batch's second rollout is still leased
    assert reap_jobs("rollouts", api=client, store=sq, older_than_s=60) == []
    sq.heartbeat(["b" * 32], owner="alive", at=time.time() - 600)
    assert reap_jobs("rollouts", api=client, store=sq, older_than_s=60) == [f"rollout-batch-{'d' * 32}"]


def test_a_batch_that_never_starts_is_classified_and_requeued(cluster: Cluster, llm_server: LLMTestServer,
                                                              sq: TraceStore, slowness: float) -> None:
    api, _ = cluster
    timeout, grace = 5.0 * slowness, 10.0 * slowness
    deadline = math.ceil(2 * timeout + grace)  # two rollouts one after the other, plus the start-up grace
    pull = A.make_tasks(llm_server, sq, 2)
    pull[0]["fault"] = "image_pull"  # the batch's pod never starts: the Job is deleted, all re-queued
    late = [{**t, "task_id": f"s{i}"} for i, t in enumerate(A.make_tasks(llm_server, sq, 2))]
    late[0]["fault"] = f"slow_start:{2 * deadline}"  # past the batch Job's deadline
    backend = _backend(api, 2, batch_linger_s=0.5, template={"startup_grace_s": grace})
    with RolloutController(AGENT, store=sq, backend=backend, concurrency=2, timeout_s=timeout, policy_version=0,
                           retry=RetryPolicy(max_attempts=2, backoff_s=0.05)) as c:
        pulled = c.run(pull)
        timed = c.run(late)
    assert [(r.status, r.attempts) for r in pulled] == [("succeeded", 2)] * 2
    errors = sorted((sq.get_rollout(r.rollout_ids[0]).error or "").split(":")[0] for r in pulled)  # type: ignore[union-attr]
    assert errors == ["BatchCutShort", "PodImagePullFailed"]
    first, second = sorted(timed, key=lambda r: r.attempts)
    assert first.status == "timeout" and first.attempts == 1
    assert f"activeDeadlineSeconds ({deadline}s)" in (first.error or "")
    assert second.status == "succeeded" and second.attempts == 2  # never started: re-queued
    assert sq.query_rollouts(status="running") == []


def test_a_pod_runs_its_batch_concurrently_with_pod_concurrency(cluster: Cluster, llm_server: LLMTestServer,
                                                                 sq: TraceStore, slowness: float) -> None:
    api, kubelet = cluster
    timeout = 8.0 * slowness
    tasks = A.make_tasks(llm_server, sq, 4, sleep=0.5)
    tasks[1].update(sleep=6 * timeout, timeout_s=timeout)  # cancelled at its own timeout; its batch-mates run
    tasks[2]["crash"] = True  # beside it, under a timeout they never reach
    backend = _backend(api, 4, pod_concurrency=4, batch_linger_s=0.5)
    with RolloutController("tests.controller.controller_agents:async_tool_agent", store=sq, backend=backend,
                           concurrency=4, timeout_s=A.UNREACHED_TIMEOUT_S, policy_version=0,
                           retry=RetryPolicy(max_attempts=1)) as c:
        results = {r.task_id: r for r in c.run(tasks)}
        (job,) = api.objects("jobs", run_selector(backend.run_id))
    assert results["t0"].status == results["t3"].status == "succeeded"
    assert results["t1"].status == "timeout" and f"{timeout:g}s timeout" in (results["t1"].error or "")
    assert results["t2"].status == "failed" and results["t2"].error == "ValueError: tool exploded"
    assert A.max_overlap(sq.query_rollouts()) == 4 and kubelet.pods_started == 1  # all four at once, one pod
    assert _env(job)["LIGHTNING_ROLLOUT_CONCURRENCY"] == "4"
    # the last starts within one timeout, the longest of the batch's own
    assert job["spec"]["activeDeadlineSeconds"] == math.ceil(2 * A.UNREACHED_TIMEOUT_S + 30)


def test_a_pod_killed_with_several_rollouts_running_fails_those_only(cluster: Cluster, llm_server: LLMTestServer,
                                                                    sq: TraceStore, tmp_path: Path) -> None:
    api, kubelet = cluster
    tasks = A.make_tasks(llm_server, sq, 6, sleep=0.3)
    pidfile = str(tmp_path / "pid")
    tasks[3]["pidfile"] = pidfile

    def killer() -> None:
        end = time.monotonic() + 60
        while not os.path.exists(pidfile) and time.monotonic() < end:
            time.sleep(0.02)
        with open(pidfile) as f:
            kubelet.kill_pod(int(f.read()), "evict")

    thread = threading.Thread(target=killer)
    thread.start()
    backend = _backend(api, 6, pod_concurrency=2, batch_linger_s=0.5)
    with RolloutController(AGENT, store=sq, backend=backend, concurrency=6, timeout_s=60, policy_version=0,
                           retry=RetryPolicy(max_attempts=3, backoff_s=0.05)) as c:
        results = c.run(tasks)
    thread.join(10)
    assert all(r.status == "succeeded" for r in results)
    firsts = {r.task_id: sq.get_rollout(r.rollout_ids[0]) for r in results}
    killed = firsts["t3"]
    assert killed is not None and "PodEvicted" in (killed.error or "") and len(sq.calls(killed.id)) == 1
    errors = {tid: (row.error or "").split(":")[0] for tid, row in firsts.items() if row and row.status == "failed"}
    assert set(errors.values()) <= {"PodEvicted", "BatchCutShort"} and errors["t3"] == "PodEvicted"
    assert all(r.attempts == (2 if r.task_id in errors else 1) for r in results)  # finished ones never rerun
    assert sq.count("llm_calls") == sum(len(sq.calls(i)) for r in results for i in r.rollout_ids)
    assert all(len(sq.calls(r.rollout_id)) == 2 for r in results)


def test_a_pods_verdict_goes_to_the_rollouts_it_was_running() -> None:
    from lightning_middleware.controller.backends.k8s_batch import assign

    a, b, c = (RolloutJob(rollout_id=x * 32, task_id="t", task={}) for x in "abc")
    evicted = RolloutOutcome(status="failed", error="PodEvicted: pod p was evicted", ended_by_controller=True)
    ok = RolloutOutcome(status="succeeded", reward=1.0)

    def errors(done: dict[str, RolloutOutcome], running: list[str], verdict: RolloutOutcome | None) -> list[str]:
        return [(o.error or o.status).split(":")[0] for o in assign([a, b, c], done, running, verdict, "p")]

    assert errors({a.rollout_id: ok}, [b.rollout_id], evicted) == ["succeeded", "PodEvicted", "BatchCutShort"]
    assert errors({a.rollout_id: ok}, [b.rollout_id, c.rollout_id], evicted) == ["succeeded", "PodEvicted",
                                                                                 "PodEvicted"]
    assert errors({}, [], evicted) == ["PodEvicted", "BatchCutShort", "BatchCutShort"]  # nothing known: the first
    assert errors({a.rollout_id: ok}, [a.rollout_id], evicted) == ["succeeded", "BatchCutShort", "BatchCutShort"]
    assert errors({a.rollout_id: ok}, [], None) == ["succeeded", "WorkerLost", "WorkerLost"]  # a clean exit
