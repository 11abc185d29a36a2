"""The Kubernetes Job backend against the emulated API server, through the official client over HTTP;
the test kubelet runs every Job's container (the worker entrypoint) as a local process."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.controller import KubernetesBackend, RetryPolicy, RolloutController, Sandbox
from lightning_middleware.controller.backends.k8s_client import api_client, reap_jobs
from lightning_middleware.controller.backends.k8s_template import RUN_LABEL, job_manifest, run_selector
from lightning_middleware.controller.jobs import RolloutJob
from lightning_middleware.testing import LLMTestServer
from lightning_middleware.testing.k8s_api import K8sAPIServer
from lightning_middleware.testing.kubelet import Kubelet
from tests.controller import controller_agents as A
from tests.controller.k8s_fixtures import ROOT, template

pytest.importorskip("kubernetes")
Cluster = tuple[K8sAPIServer, Kubelet]


@pytest.fixture
def sq(tmp_path: Path) -> TraceStore:
    s = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    yield s
    s.close()


def _backend(api: K8sAPIServer, **kw: Any) -> KubernetesBackend:
    return KubernetesBackend(template(**kw.pop("template", {})), api_url=api.url, **kw)


def test_rollouts_run_as_jobs_and_land_in_the_store(cluster: Cluster, llm_server: LLMTestServer,
                                                    sq: TraceStore) -> None:
    api, kubelet = cluster
    sandbox = Sandbox(egress_to=({"ipBlock": {"cidr": "127.0.0.1/32"}},), read_only_root_fs=True)
    backend = _backend(api, template={"ttl_seconds_after_finished": 3600, "sandbox": sandbox}, network_policy=True)
    with RolloutController("tests.controller.controller_agents:tool_agent", store=sq, backend=backend,
                           concurrency=4, timeout_s=60) as c:
        results = c.run(A.make_tasks(llm_server, sq, 2), n=2)
        jobs = api.objects("jobs", run_selector(backend.run_id))  # kept until their TTL, or close()
    assert [r.status for r in results] == ["succeeded"] * 4 and all(r.reward == 1.0 for r in results)
    assert all(len(sq.calls(r.rollout_id)) == 2 for r in results)  # the pods' LLM calls, recorded
    assert sorted(j["metadata"]["labels"]["lightning-middleware/rollout"] for j in jobs) == \
        sorted(r.rollout_id for r in results)
    spec = jobs[0]["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 90 and spec["ttlSecondsAfterFinished"] == 3600
    env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert env["LIGHTNING_AGENT"] == "tests.controller.controller_agents:tool_agent"
    assert env["LIGHTNING_STORE_URL"] == sq.url.render_as_string(hide_password=False)
    assert all(j["status"]["succeeded"] == 1 for j in jobs) and kubelet.pods_started == 4
    assert spec["template"]["spec"]["automountServiceAccountToken"] is False
    (policy,) = api.objects("networkpolicies")  # created at start, once
    assert policy["spec"]["egress"][1] == {"to": [{"ipBlock": {"cidr": "127.0.0.1/32"}}]}
    assert sq.query_rollouts(status="running") == [] and api.objects("jobs") == []  # close() deleted them


def test_failures_are_classified_and_infrastructure_ones_retried(cluster: Cluster, llm_server: LLMTestServer,
                                                                 sq: TraceStore, slowness: float) -> None:
    api, kubelet = cluster
    # The grace covers eight pods starting at once (4.2 s calibrated, QUIET_STARTS_S): at 10 s a pod on a
    # 2-core AVX2 EPYC running the quick tier's three workers started after it, and t5's Job deadline
    # fired before the worker's own alarm; 20 s leaves the margin the module's slowness probe can miss.
    timeout, grace = 10.0 * slowness, 20.0 * slowness
    faults = ["oom", "image_pull", "evict", "node_lost"]
    tasks = A.make_tasks(llm_server, sq, 8)
    for t, fault in zip(tasks, faults):
        t["fault"] = fault
    tasks[4]["exit_code"] = 3  # the agent's process dies: failed with its last log lines, not retried
    tasks[5]["sleep"] = 6 * timeout  # the worker's own alarm: timeout, with the spans so far
    tasks[6]["fault"] = f"slow_start:{1.5 * (timeout + grace):g}"  # never started in time: the Job's deadline
    tasks[7]["crash"] = True  # the agent raised: failed, not retried
    for t in tasks[5:7]:  # those two under the short timeout; the rest under one they never reach
        t["timeout_s"] = timeout
    backend = _backend(api, template={"startup_grace_s": grace})
    with RolloutController("tests.controller.controller_agents:tool_agent", store=sq, backend=backend,
                           concurrency=8, timeout_s=A.UNREACHED_TIMEOUT_S,
                           retry=RetryPolicy(max_attempts=2, backoff_s=0.05)) as c:
        results = {r.task_id: r for r in c.run(tasks)}
    for i, fault in enumerate(faults):
        res = results[f"t{i}"]
        assert res.status == "succeeded" and res.attempts == 2, (fault, res)
        first = sq.get_rollout(res.rollout_ids[0])
        assert first is not None and first.status == "failed"
        want = {"oom": "PodOOMKilled: pod", "image_pull": "PodImagePullFailed", "evict": "PodEvicted",
                "node_lost": "PodNodeLost"}[fault]
        assert want in (first.error or ""), (fault, first.error)
    assert "OOM-killed (memory limit 512Mi)" in (sq.get_rollout(results["t0"].rollout_ids[0]).error or "")
    assert "ErrImagePull" in (sq.get_rollout(results["t1"].rollout_ids[0]).error or "") \
        or "ImagePullBackOff" in (sq.get_rollout(results["t1"].rollout_ids[0]).error or "")
    exited = results["t4"]
    first_exit = sq.get_rollout(exited.rollout_ids[0])
    assert exited.status == "failed" and exited.attempts == 1 and "exited with code 3" in exited.error, \
        (exited, first_exit.error if first_exit else None)
    assert "agent log line 29" in exited.error and "agent log line 5\n" not in exited.error  # the last 20 lines
    assert len(sq.calls(exited.rollout_id)) == 1  # the span flushed before the exit stays
    slow = results["t5"]
    assert slow.status == "timeout" and f"{timeout:g}s timeout" in slow.error and len(sq.calls(slow.rollout_id)) == 1
    late = results["t6"]
    assert late.status == "timeout" and f"activeDeadlineSeconds ({math.ceil(timeout + grace)}s)" in late.error
    assert late.attempts == 1
    crash = results["t7"]
    assert crash.status == "failed" and crash.error == "ValueError: tool exploded" and crash.attempts == 1
    assert sq.query_rollouts(status="running") == []
    assert not [p for p in api.objects("pods") if p["metadata"]["name"].startswith("rollout-")
                and p["status"].get("containerStatuses", [{}])[0].get("state", {}).get("waiting")]  # pull: deleted


def test_a_pod_killed_after_its_rollout_succeeded_keeps_the_rollout(cluster: Cluster, llm_server: LLMTestServer,
                                                                   sq: TraceStore, caplog: pytest.LogCaptureFixture
                                                                   ) -> None:
    """An OOM kill in the pod's teardown, after the worker ended its rollout: the store has the whole
    rollout, so it is the outcome, and no retry samples the task a second time."""
    api, _ = cluster
    [task] = A.make_tasks(llm_server, sq, 1)
    task["fault"] = "oom_at_exit"
    with RolloutController("tests.controller.controller_agents:tool_agent", store=sq, backend=_backend(api),
                           concurrency=1, timeout_s=60, retry=RetryPolicy(max_attempts=2, backoff_s=0.05)) as c:
        [res] = c.run([task])
        [pod] = api.objects("pods")  # before close() deletes it
    assert res.status == "succeeded" and res.attempts == 1 and res.reward == 1.0, res
    assert [r.status for r in sq.query_rollouts()] == ["succeeded"] and len(sq.calls(res.rollout_id)) == 2
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "OOMKilled"  # the fault landed
    assert "failed after the rollout succeeded" in caplog.text


def test_concurrency_limit_pause_and_drain(cluster: Cluster, llm_server: LLMTestServer, sq: TraceStore) -> None:
    api, kubelet = cluster
    backend = _backend(api, max_jobs=2)
    c = RolloutController("tests.controller.controller_agents:tool_agent", store=sq, backend=backend, concurrency=4)
    c.pause()
    thread = c.start_continuous(A.make_tasks(llm_server, sq, 3, sleep=0.3), n=2, groups_in_flight=2)
    time.sleep(1.5)
    assert api.objects("jobs") == [] and c.stats.started == 0  # paused: no Job created
    c.resume()
    end = time.monotonic() + 60
    while c.stats.groups_finished < 1 and time.monotonic() < end:
        time.sleep(0.05)
    assert c.drain(timeout=60)
    created = len(api.objects("jobs"))
    assert kubelet.active == 0
    time.sleep(1.0)
    assert len(api.objects("jobs")) == created and kubelet.active == 0  # drained: nothing new starts
    c.resume()
    time.sleep(0.5)
    c.stop()
    thread.join(120)
    c.close()
    assert kubelet.max_active == 2 and c.stats.max_in_flight == 4  # 4 waiting in the controller, 2 Jobs
    assert all(r.status == "succeeded" for r in sq.query_rollouts())
    assert api.objects("jobs", run_selector(backend.run_id)) == []  # close() deleted the run's Jobs


@pytest.mark.parametrize(("sig", "per_job"), [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 3)])
def test_a_signal_deletes_the_runs_jobs(cluster: Cluster, llm_server: LLMTestServer, sq: TraceStore,
                                        tmp_path: Path, sig: signal.Signals, per_job: int) -> None:
    api, kubelet = cluster
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in A.make_tasks(llm_server, sq, 3, sleep=60)))
    tmpl = tmp_path / "pod.toml"
    worker = [sys.executable, "-m", "lightning_middleware.cli", "rollouts", "worker"]  # the CLI entrypoint
    tmpl.write_text("[pod]\nimage = 'lightning/rollout:test'\nnamespace = 'rollouts'\n"
                    f"command = {json.dumps(worker)}\n"
                    f"env = {{ PYTHONPATH = {json.dumps(str(ROOT))} }}\n")
    cmd = [sys.executable, "-m", "lightning_middleware.cli", "rollouts", "run", "--agent",
           "tests.controller.controller_agents:tool_agent", "--tasks", str(tasks), "--store",
           sq.url.render_as_string(hide_password=False), "--backend", "k8s", "--k8s-template", str(tmpl),
           "--k8s-api-url", api.url, "--concurrency", "3", "--k8s-rollouts-per-job", str(per_job)]
    # SIGINT at its default in the child, as a terminal starts it: a suite run as a background job of a
    # non-interactive shell ignores SIGINT, and the child would inherit that
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    end = time.monotonic() + 90  # a batch runs its rollouts one after another: one of them is running
    while len(sq.query_rollouts(status="running")) < 3 // per_job and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.1)
    assert len(api.objects("jobs")) == 3 // per_job, proc.stdout.read() if proc.poll() is not None else "no jobs"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out
    assert api.objects("jobs") == [] and api.objects("pods") == [], out
    end = time.monotonic() + 30
    while kubelet.active and time.monotonic() < end:
        time.sleep(0.05)
    assert kubelet.active == 0  # the pods' processes were stopped
    ended = sq.query_rollouts()  # the batch's rollouts that never started too
    # either signal cancels the run as Ctrl-C does: each rollout records its end, and its Job is deleted
    assert [(r.status.value, r.error) for r in ended] == [("failed", "cancelled by the controller")] * 3


def test_reap_deletes_orphaned_jobs_by_label(cluster: Cluster, sq: TraceStore) -> None:
    api, _ = cluster
    client = api_client(api_url=api.url)
    from kubernetes.client import BatchV1Api

    batch = BatchV1Api(client)
    tmpl = template(startup_grace_s=0.0, image="never/pulled:x")  # fault-free, but we delete before it matters
    ids = ["a" * 32, "b" * 32, "c" * 32]
    for rid, run in zip(ids, ["dead", "dead", "other"]):
        job = RolloutJob(rollout_id=rid, task_id="t", task={}, store_url="sqlite://")
        batch.create_namespaced_job("rollouts", job_manifest(tmpl, job, run_id=run, agent_ref="m:f"))
    sq.heartbeat([ids[1]], owner="alive")  # its controller still heartbeats it
    assert reap_jobs("rollouts", api=client, store=sq, older_than_s=60) == []  # too young to be orphans

    def age_jobs() -> None:  # as if they were created ten minutes ago
        for (plural, _, _), obj in api.store.objects.items():
            if plural == "jobs":
                obj["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    api.call(age_jobs)
    orphans = sorted(f"rollout-{r}" for r in (ids[0], ids[2]))
    assert sorted(reap_jobs("rollouts", api=client, store=sq, older_than_s=60, dry_run=True)) == orphans
    assert len(api.objects("jobs")) == 3  # a dry run deletes nothing
    assert sorted(reap_jobs("rollouts", api=client, store=sq, older_than_s=60)) == orphans
    sq.heartbeat([ids[1]], owner="alive", at=time.time() - 600)  # now its controller is gone too
    assert reap_jobs("rollouts", api=client, store=sq, older_than_s=60) == [f"rollout-{ids[1]}"]
    assert api.objects("jobs") == []
    batch.create_namespaced_job("rollouts", job_manifest(tmpl, RolloutJob(ids[0], "t", {}), run_id="x",
                                                         agent_ref="m:f"))
    assert reap_jobs("rollouts", api=client, run_id="x") == [f"rollout-{ids[0]}"]
    assert [j["metadata"]["labels"][RUN_LABEL] for j in api.objects("jobs")] == []


def test_an_unreachable_api_server_fails_start_with_a_clear_error(sq: TraceStore) -> None:
    from lightning_middleware.testing import free_port

    backend = KubernetesBackend(template(), api_url=f"http://127.0.0.1:{free_port()}", start_timeout_s=2)
    with RolloutController("tests.controller.controller_agents:tool_agent", store=sq, backend=backend) as c:
        with pytest.raises(Exception, match="cannot list Jobs/Pods in namespace 'rollouts' within 2s") as err:
            c.run([{"task_id": "a"}])
    assert "Connection refused" in str(err.value) or "MaxRetryError" in str(err.value)


def test_the_worker_entrypoint_refuses_a_bad_environment(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_middleware.controller.worker import run_worker

    assert run_worker({}) == 2
    assert "needs LIGHTNING_AGENT, LIGHTNING_ROLLOUT_JOB" in capsys.readouterr().err
    assert run_worker({"LIGHTNING_AGENT": "m:f", "LIGHTNING_ROLLOUT_JOB": "{not json"}) == 2
    assert "LIGHTNING_ROLLOUT_JOB is not a rollout job" in capsys.readouterr().err
    job = json.dumps({"rollout_id": "r", "task_id": "t", "task": {}})
    assert run_worker({"LIGHTNING_AGENT": "m:f", "LIGHTNING_ROLLOUT_JOB": job}) == 2
    assert "needs LIGHTNING_STORE_URL" in capsys.readouterr().err
    assert run_worker({"LIGHTNING_AGENT": "nosuch_mod:f", "LIGHTNING_ROLLOUT_JOB": job,
                       "LIGHTNING_STORE_URL": "sqlite://"}) == 2
    assert "cannot import the agent 'nosuch_mod:f'" in capsys.readouterr().err


def test_a_sandboxed_pods_breach_is_classed_and_not_retried(cluster: Cluster, sq: TraceStore) -> None:
    """A pod under a `Sandbox` classes an error that is a breach as the local sandbox does (the
    emulated kubelet runs pods as local processes and enforces none of it: these attacks fail on
    the host too, a refused port and a path that is not there); the same attacks in a pod without a
    sandbox are ordinary errors, and a refused connection is retried."""
    import socket

    api, _ = cluster
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        idle_port = free.getsockname()[1]
    tasks = [{"task_id": "net", "attack": "connect", "port": idle_port},
             {"task_id": "fs", "attack": "read_store", "path": "/nonexistent/lightning/traces.db"}]
    retry = RetryPolicy(max_attempts=2, backoff_s=0.05)  # ConnectionError is retried by default
    outcomes = {}
    for boxed in (True, False):
        backend = _backend(api, template={"sandbox": Sandbox()} if boxed else {})
        with RolloutController("tests.controller.sandbox_agents:attacker", store=sq, backend=backend,
                               concurrency=2, timeout_s=60, retry=retry) as c:
            outcomes[boxed] = {r.task_id: r for r in c.run(tasks)}
    sandboxed, plain = outcomes[True], outcomes[False]
    assert (sandboxed["net"].status, sandboxed["net"].attempts) == ("failed", 1)
    assert sandboxed["net"].error.startswith("sandbox_network: ConnectionRefusedError")
    assert sandboxed["fs"].error.startswith("sandbox_fs: FileNotFoundError") and sandboxed["fs"].attempts == 1
    assert (plain["net"].attempts, plain["net"].error.split(":")[0]) == (2, "ConnectionRefusedError")
    assert plain["fs"].error.startswith("FileNotFoundError")


GATEWAY_TOKEN = "k8s-gateway-token"


def test_pods_that_reach_only_the_gateway(cluster: Cluster, llm_server: LLMTestServer, sq: TraceStore) -> None:
    """With `gateway=`, a pod holds neither the store URL nor the gateway's token: only its rollout's
    route and a token for it alone. Its calls are recorded by the gateway with token IDs, the gateway's
    reward configuration scores it, and what the gateway refuses the pod's token (the admin routes,
    another rollout, its own reward under `agent_reward = false`) ends the rollout failed with its
    class, not retried. The emulated cluster enforces no NetworkPolicy or file system: those attacks
    run against the local sandbox (test_sandbox.py) and a real cluster (test_k8s_real_cluster.py)."""
    from lightning_middleware import RewardConfig
    from lightning_middleware.gateway import Gateway
    from lightning_middleware.records import SANDBOX_BREACH

    api, _ = cluster
    rewards = RewardConfig.from_dict({"rules": {"succeeded": 1.0}, "agent_reward": False})
    with Gateway([llm_server.base_url], sq, rewards=rewards, token=GATEWAY_TOKEN, health_interval_s=0) as gw:
        retry = RetryPolicy(max_attempts=3, retry_on=("ConnectionError", "OSError", "httpx.HTTPError"))

        def run(agent: str, tasks: list[dict[str, Any]]) -> dict[str, Any]:
            backend = _backend(api, template={"sandbox": Sandbox(), "ttl_seconds_after_finished": 3600},
                               gateway=gw.url, gateway_token=GATEWAY_TOKEN)
            with RolloutController(agent, store=sq, backend=backend, concurrency=4, timeout_s=60, retry=retry) as c:
                results = {r.task_id: r for r in c.run(tasks)}
                jobs = api.objects("jobs", run_selector(backend.run_id))  # kept until their TTL, or close()
            return {"results": results, "jobs": jobs}

        good = run("tests.controller.sandbox_agents:caller", [{"task_id": f"ask-{i}", "prompt": "hi"}
                                                              for i in range(2)])
        other = next(iter(good["results"].values())).rollout_id
        bad = run("tests.controller.sandbox_agents:attacker", [
            {"task_id": "read_secret", "attack": "read_secret", "var": "LIGHTNING_STORE_URL"},
            {"task_id": "gateway_admin", "attack": "gateway_admin"},
            {"task_id": "other_rollout", "attack": "other_rollout", "other": other},
            {"task_id": "self_reward", "attack": "self_reward"}])
        assert not gw.gate.paused
    for r in good["results"].values():
        assert (r.status, r.reward, r.attempts) == ("succeeded", 1.0, 1), r.error
        [call] = sq.calls(r.rollout_id)
        assert call.prompt_token_ids and call.completion_token_ids
        assert "agent" not in {w.name for w in sq.rewards(r.rollout_id)}  # its returned 1.0 was refused
    assert len(good["jobs"]) == 2
    for job in good["jobs"]:
        env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        rid = env["LIGHTNING_ROLLOUT_ID"]
        assert "LIGHTNING_STORE_URL" not in env and GATEWAY_TOKEN not in json.dumps(job)
        assert env["OPENAI_BASE_URL"] == f"{gw.url}/rollouts/{rid}/v1" and env["OPENAI_API_KEY"].startswith("lmr1.")
    events = {e.data["rollout_id"]: e.data["class"] for e in sq.events(kind=SANDBOX_BREACH)}
    got = {name: (r.status, events.get(r.rollout_id), r.attempts) for name, r in bad["results"].items()}
    assert got == {"read_secret": ("failed", None, 1), "gateway_admin": ("failed", "sandbox_network", 1),
                   "other_rollout": ("failed", "sandbox_network", 1),
                   "self_reward": ("failed", "sandbox_reward", 1)}, {n: r.error for n, r in bad["results"].items()}
    assert bad["results"]["read_secret"].error.startswith("KeyError")
    assert sq.query_rollouts(status="running") == []
    assert [w.value for w in sq.rewards(bad["results"]["self_reward"].rollout_id) if w.name == "agent"] == []


def test_a_pod_reaching_only_the_gateway_needs_its_token(monkeypatch) -> None:
    from lightning_middleware.errors import UsageError

    monkeypatch.delenv("LIGHTNING_GATEWAY_TOKEN", raising=False)
    with pytest.raises(UsageError, match="need its token"):
        KubernetesBackend(template(), gateway="http://gw:8100")
    with pytest.raises(UsageError, match="runs one rollout"):
        KubernetesBackend(template(), gateway="http://gw:8100", gateway_token="t", rollouts_per_job=4)
    from lightning_middleware.cli import build_parser
    from lightning_middleware.controller.cli import backend_from

    argv = ["rollouts", "run", "--agent", "m:f", "--tasks", "t.jsonl", "--backend", "k8s", "--k8s-image", "img",
            "--gateway", "http://gw:8100"]
    with pytest.raises(UsageError, match="need its token"):
        backend_from(build_parser().parse_args(argv))
    monkeypatch.setenv("LIGHTNING_GATEWAY_TOKEN", "t0k")
    backend = backend_from(build_parser().parse_args(argv))
    assert isinstance(backend, KubernetesBackend) and backend.gateway is not None
    assert backend.gateway.scoped_token("r1").startswith("lmr1.")


def test_an_unrecorded_job_reports_what_the_agent_returned_and_its_deadline() -> None:
    """What a pod that reaches only the gateway runs (execution.execute_unrecorded): no store, the
    agent's returned number as the outcome's reward (its backend posts it), its errors and its
    deadline as a recorded job's would be, sync (SIGALRM in the main thread) and async."""
    import asyncio

    from lightning_middleware.controller.execution import execute_unrecorded

    def job(**kw: Any) -> RolloutJob:
        return RolloutJob(rollout_id="r", task_id="t", task=kw.pop("task", {}), store_url=None, **kw)

    assert execute_unrecorded(lambda task: 0.25, job()).reward == 0.25
    assert execute_unrecorded(lambda task: {"reward": 1, "why": "x"}, job()).reward == 1.0
    none = execute_unrecorded(lambda task: None, job())
    assert (none.status, none.reward) == ("succeeded", None)
    bad = execute_unrecorded(lambda task: "yes", job())
    assert bad.status == "failed" and bad.error.startswith("TypeError")
    slept = execute_unrecorded(lambda task: time.sleep(5), job(timeout_s=0.2))
    assert slept.status == "timeout" and slept.duration_s < 4  # the agent sleeps 5 s

    async def waits(task: dict[str, Any]) -> float:
        await asyncio.sleep(5)
        return 1.0

    late = execute_unrecorded(waits, job(timeout_s=0.2))
    assert late.status == "timeout" and late.duration_s < 4
