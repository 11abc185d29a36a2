"""Rollouts as Kubernetes Jobs, one per rollout or a batch of rollouts per Job (k8s_batch.py), through
the official `kubernetes` client (the `k8s` extra), imported when the backend starts, never by the
light core's import path.

Each Job runs the pod template's image with the worker entrypoint (`lightning-mw rollouts worker`),
which runs the agent exactly as a local worker process would and reaches the store by its URL.
With `gateway=`, a pod reaches only the gateway instead: the backend creates each rollout there,
the pod gets that rollout's route and a token for it alone (no store URL, no gateway token), and
the backend finishes the rollout there with the pod's verdict (gateway_rollouts.py), as the
sandboxed backend does on one machine.
Completion is watched, not polled: one watch on the run's Jobs and one on its Pods (label
`lightning-middleware/run=<run id>`) feed every waiting rollout. See docs/kubernetes.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lightning_middleware.asgi.auth import TOKEN_ENV
from lightning_middleware.controller.backends.gateway_rollouts import GatewayRollouts
from lightning_middleware.controller.backends.k8s_batch import Batcher, assign, parse_batch_message, termination_message
from lightning_middleware.controller.backends.k8s_client import (
    KubernetesAPIError,
    agent_reference,
    api_client,
)
from lightning_middleware.controller.backends.k8s_status import PodNodeLost, Verdict, judge
from lightning_middleware.controller.backends.k8s_template import (
    BATCH_LABEL,
    ROLLOUT_LABEL,
    PodTemplate,
    batch_job_name,
    batch_manifest,
    job_manifest,
    job_name,
    jobs_deadline_s,
    jobs_payload,
    network_policy,
    run_selector,
)
from lightning_middleware.controller.execution import AgentFn
from lightning_middleware.controller.jobs import (
    RolloutJob,
    RolloutOutcome,
    SandboxLimit,
    WorkerLost,
    breach_in,
    type_names,
)
from lightning_middleware.errors import UsageError
from lightning_middleware.records import Mode, Rollout, RolloutStatus
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)
__all__ = ["KubernetesBackend"]
ENV_PAYLOAD_LIMIT = 96 * 1024  # bytes; Linux refuses a single env string over 128 KiB (MAX_ARG_STRLEN)


@dataclass
class _Tracked:
    """One Job (one rollout, or a batch) as its watches last reported it."""

    jobs: list[RolloutJob]
    label: str  # the label that names this Job's pods: the rollout's, or the batch's
    key: str
    name: str
    deadline_s: int | None
    loop: asyncio.AbstractEventLoop
    changed: asyncio.Event
    job_obj: dict[str, Any] | None = None
    pod: dict[str, Any] | None = None
    pod_deleted: bool = False
    job_deleted: bool = False


class KubernetesBackend:
    """One Kubernetes Job per rollout (or per batch of up to `rollouts_per_job`), in `template.namespace`.

    `rollouts_per_job`: a Job's pod runs up to this many rollouts, one after another or
    `pod_concurrency` at a time, each with its own timeout and outcome, saving a pod start per rollout;
    a batch leaves when full or `batch_linger_s` after its first rollout arrived. `max_jobs`: at most
    this many of this run's Jobs exist at once (the controller's `concurrency` counts rollouts).
    `network_policy`: create the sandbox NetworkPolicy at start (`sandbox.egress_to`); usually it is
    part of the manifests. `backstop_s`: past the Job's deadline, the controller stops waiting for the
    cluster and deletes the Job itself. `close()` deletes the run's Jobs: leaving
    `with RolloutController(...)` on Ctrl-C does it, and `lightning-mw rollouts run` turns SIGTERM
    into Ctrl-C (in your own program:
    `signal.signal(signal.SIGTERM, signal.default_int_handler)`).

    `gateway`: the gateway's URL (as this process reaches it) for pods that reach only the gateway;
    `gateway_token`: its token (default $LIGHTNING_GATEWAY_TOKEN), from which each pod's
    rollout-scoped token is derived; the template's `gateway_url` is the URL the pods get (default
    `gateway`). One rollout per Job; the gateway's reward configuration scores the rollouts.
    """

    name = "k8s"
    out_of_process = True

    def __init__(self, template: PodTemplate, *, api_url: str | None = None, kubeconfig: str | None = None,
                 context: str | None = None, run_id: str | None = None, max_jobs: int | None = None,
                 api_threads: int = 16, log_lines: int = 20, network_policy: bool = False,
                 backstop_s: float = 30.0, watch_timeout_s: int = 60, start_timeout_s: float = 30.0,
                 settle_s: float = 5.0, rollouts_per_job: int = 1, batch_linger_s: float = 0.1,
                 pod_concurrency: int = 1, gateway: str | None = None, gateway_token: str | None = None) -> None:
        if rollouts_per_job < 1 or pod_concurrency < 1:
            raise ValueError(f"rollouts_per_job and pod_concurrency must be >= 1, not {rollouts_per_job}, "
                             f"{pod_concurrency}")
        self.gateway: GatewayRollouts | None = None
        if gateway is not None:
            token = gateway_token or os.environ.get(TOKEN_ENV)
            if not token:
                raise UsageError(f"pods that reach only the gateway need its token (gateway_token or ${TOKEN_ENV}): "
                                 "each pod's rollout-scoped token is derived from it")
            if rollouts_per_job != 1:
                raise UsageError("a pod that reaches only the gateway runs one rollout (rollouts_per_job=1)")
            self.gateway = GatewayRollouts(gateway, token)
        self.template = template
        self.rollouts_per_job = rollouts_per_job
        self.pod_concurrency = pod_concurrency
        self.batch_linger_s = batch_linger_s
        self.jobs_created = 0
        self.namespace = template.namespace
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.max_jobs = max_jobs
        self.log_lines = log_lines
        self.create_network_policy = network_policy
        self.backstop_s = backstop_s
        self.watch_timeout_s = watch_timeout_s
        self.start_timeout_s = start_timeout_s
        self.settle_s = settle_s
        self._conn = {"api_url": api_url, "kubeconfig": kubeconfig, "context": context, "pool_size": api_threads + 4}
        self._pool = concurrent.futures.ThreadPoolExecutor(api_threads, thread_name_prefix="k8s-api")
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watchers: list[Any] = []
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._batcher: Batcher | None = None
        self._api: Any = None
        self._last_watch_error: str | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, agent: AgentFn | str, store: TraceStore) -> None:
        from kubernetes import client

        self._agent_ref = agent_reference(agent)
        self._store = store
        if self._api is not None:
            return
        self._api = api_client(**self._conn)  # type: ignore[arg-type]
        self._batch, self._core = client.BatchV1Api(self._api), client.CoreV1Api(self._api)
        if self.create_network_policy and self.template.sandbox is not None \
                and self.template.sandbox.egress_to is not None:
            self._ensure_network_policy(client)
        ready = [threading.Event(), threading.Event()]
        for kind, lister, ev in (("jobs", self._batch.list_namespaced_job, ready[0]),
                                 ("pods", self._core.list_namespaced_pod, ready[1])):
            threading.Thread(target=self._watch, args=(kind, lister, ev), daemon=True,
                             name=f"k8s-watch-{kind}").start()
        end = time.monotonic() + self.start_timeout_s
        if not all(ev.wait(max(0.0, end - time.monotonic())) for ev in ready):
            raise KubernetesAPIError(f"cannot list Jobs/Pods in namespace {self.namespace!r} within "
                                     f"{self.start_timeout_s:g}s at {self._api.configuration.host} "
                                     f"(last error: {self._last_watch_error or 'none'})")

    def _ensure_network_policy(self, client: Any) -> None:
        sb = self.template.sandbox
        assert sb is not None and sb.egress_to is not None
        body = network_policy(f"{self.template.name_prefix}-sandbox", self.namespace, sb.egress_to)
        try:
            client.NetworkingV1Api(self._api).create_namespaced_network_policy(self.namespace, body)
        except client.ApiException as exc:
            if exc.status != 409:  # it exists already: the manifests (or another run) made it
                raise

    def close(self) -> None:
        """Delete this run's Jobs (and their pods); rollouts still waiting end `failed` in the store."""
        self._closing.set()
        for w in self._watchers:
            w.stop()
        if self._api is not None:
            try:
                self.delete_run_jobs()
            except Exception as exc:  # noqa: BLE001 - the cluster may be gone; `reap` cleans up later
                log.warning("deleting the Jobs of run %s failed (run `lightning-mw k8s reap`): %s", self.run_id, exc)
            with self._lock:
                left = [job for t in self._tracked.values() for job in t.jobs]
            for job in left:
                self._end_in_store(job, "failed", "cancelled: the controller stopped and deleted the rollout's Job")
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.gateway is not None:
            self.gateway.close()

    def delete_run_jobs(self) -> None:
        sel = run_selector(self.run_id)
        self._batch.delete_collection_namespaced_job(self.namespace, label_selector=sel,
                                                     propagation_policy="Background")
        self._core.delete_collection_namespaced_pod(self.namespace, label_selector=sel)

    def _end_in_store(self, job: RolloutJob, status: str, error: str) -> None:
        template = Rollout(id=job.rollout_id, task_id=job.task_id, mode=Mode(job.mode), input=job.task,
                           metadata=job.metadata, policy_version=job.policy_version,
                           created_at=job.created_at or time.time())
        try:
            self._store.end_rollout_if_running(template, status=status, error=error)
        except Exception as exc:  # noqa: BLE001 - the lease reaper ends it later
            log.warning("could not end rollout %s in the store: %s", job.rollout_id, exc)

    # -- watching ------------------------------------------------------------------------
    def _watch(self, kind: str, lister: Callable[..., Any], ready: threading.Event) -> None:
        from kubernetes import watch
        from kubernetes.client import ApiException

        sel = run_selector(self.run_id)
        rv: str | None = None
        while not self._closing.is_set():
            w = watch.Watch()
            self._watchers.append(w)
            try:
                if rv is None:  # (re)list: the state now, then changes from that version on
                    listed = lister(self.namespace, label_selector=sel, _request_timeout=30)
                    rv = listed.metadata.resource_version
                    for item in listed.items:
                        self._on(kind, "ADDED", self._api.sanitize_for_serialization(item))
                    ready.set()
                # deserialize=False: plain dicts, not the client's models (a third of the per-Job CPU)
                for ev in w.stream(lister, self.namespace, label_selector=sel, resource_version=rv, deserialize=False,
                                   timeout_seconds=self.watch_timeout_s, _request_timeout=self.watch_timeout_s + 30):
                    obj = ev.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._on(kind, ev["type"], obj)
            except ApiException as exc:
                if exc.status == 410:  # our version was compacted away: relist
                    rv = None
                    continue
                self._watch_failed(kind, exc)
            except KeyError:  # the client's ERROR-event path without deserializing (410 Gone): relist
                rv = None
            except Exception as exc:  # noqa: BLE001 - a dropped connection: watch again
                self._watch_failed(kind, exc)
            finally:
                self._watchers.remove(w)

    def _watch_failed(self, kind: str, exc: BaseException) -> None:
        self._last_watch_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
        if not self._closing.is_set():
            log.warning("watching %s of run %s failed, watching again: %s", kind, self.run_id, exc)
            self._closing.wait(0.5)

    def _on(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        key = labels.get(BATCH_LABEL) or labels.get(ROLLOUT_LABEL)
        with self._lock:
            tracked = self._tracked.get(key or "")
            if tracked is None:
                return
            if kind == "jobs":
                tracked.job_obj, tracked.job_deleted = obj, event == "DELETED"
            else:
                tracked.pod, tracked.pod_deleted = obj, event == "DELETED"
        tracked.loop.call_soon_threadsafe(tracked.changed.set)

    # -- one rollout ---------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        if self.gateway is not None and job.rewards is not None:
            raise UsageError("a rollout the gateway records is scored by the gateway's reward configuration "
                             "(lightning-mw gateway --rewards); leave the controller's rewards unset")
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_jobs or 1_000_000), loop
        if self.rollouts_per_job == 1:
            return (await self._run_jobs([job]))[0]
        if self._batcher is None or self._batcher.loop is not loop:
            self._batcher = Batcher(self.rollouts_per_job, self.batch_linger_s, self._run_jobs, loop)
        return await self._batcher.submit(job)

    async def _run_jobs(self, jobs: list[RolloutJob]) -> list[RolloutOutcome]:
        """One Job for `jobs` (split in halves while its env would be too large); one outcome each."""
        if len(jobs) > 1 and len(jobs_payload(jobs).encode()) > ENV_PAYLOAD_LIMIT:
            half = len(jobs) // 2
            parts = await asyncio.gather(self._run_jobs(jobs[:half]), self._run_jobs(jobs[half:]))
            return parts[0] + parts[1]
        assert self._slots is not None
        async with self._slots:
            t0 = time.monotonic()
            if self.gateway is not None and (made := await self.gateway.create(jobs[0], t0, "k8s")) is not None:
                return [made]  # the gateway is unreachable or refused it: infrastructure
            tracked = self._track(jobs)
            try:
                manifest = self._manifest(tracked)
                refused = await self._create(manifest, t0)
                if refused is not None:
                    return [await self._through_gateway(jobs[0], refused, t0) if self.gateway else refused] * len(jobs)
                self.jobs_created += 1
                verdict = await self._wait(tracked)
                if len(jobs) == 1:
                    outcome = await self._conclude(tracked, verdict, t0)
                    return [await self._through_gateway(jobs[0], outcome, t0) if self.gateway else outcome]
                return await self._conclude_batch(tracked, verdict, t0)
            except asyncio.CancelledError:
                await asyncio.shield(self._call(self._delete_job, tracked.name))
                raise
            finally:
                with self._lock:
                    self._tracked.pop(tracked.key, None)

    def _track(self, jobs: list[RolloutJob]) -> _Tracked:
        loop = asyncio.get_running_loop()
        deadline = jobs_deadline_s(self.template, jobs, self.pod_concurrency)
        if len(jobs) == 1:
            rid = jobs[0].rollout_id
            tracked = _Tracked(jobs, ROLLOUT_LABEL, rid, job_name(self.template, rid), deadline, loop, asyncio.Event())
        else:
            bid = uuid.uuid4().hex
            tracked = _Tracked(jobs, BATCH_LABEL, bid, batch_job_name(self.template, bid), deadline, loop,
                               asyncio.Event())
        with self._lock:
            self._tracked[tracked.key] = tracked
        return tracked

    async def _through_gateway(self, job: RolloutJob, outcome: RolloutOutcome, t0: float) -> RolloutOutcome:
        """Finish a rollout the gateway records with the pod's verdict; a breach the gateway saw wins."""
        assert self.gateway is not None
        breach = breach_in(outcome.error_types)
        seen = await self._call(self.gateway.breach_seen, self._store, job.rollout_id)
        status, error = outcome.status, outcome.error
        if seen is not None:
            breach, error, status = seen[0], seen[1], RolloutStatus.FAILED.value
        if breach is not None and breach.kind not in str(error):
            error = f"{breach.kind}: {error}"
        done = await self.gateway.finish(job, t0, status, error, breach, outcome.reward, outcome.worker,
                                         outcome.error_types)
        return replace(done, duration_s=outcome.duration_s or done.duration_s,
                       ended_by_controller=outcome.ended_by_controller or done.ended_by_controller)

    def _manifest(self, tracked: _Tracked) -> dict[str, Any]:
        if tracked.label == ROLLOUT_LABEL:
            job = tracked.jobs[0]
            gateway = None if self.gateway is None else (
                self.template.gateway_url or self.gateway.url, self.gateway.scoped_token(job.rollout_id))
            return job_manifest(self.template, job, run_id=self.run_id, agent_ref=self._agent_ref, gateway=gateway)
        return batch_manifest(self.template, tracked.jobs, run_id=self.run_id, batch_id=tracked.key,
                              agent_ref=self._agent_ref, concurrency=self.pod_concurrency)

    async def _create(self, manifest: dict[str, Any], t0: float) -> RolloutOutcome | None:
        from kubernetes.client import ApiException

        try:
            await self._call(self._batch.create_namespaced_job, self.namespace, manifest)
            return None
        except ApiException as exc:
            retry = exc.status is None or exc.status >= 500 or exc.status == 429
            err: Exception = (KubernetesAPIError if retry else RuntimeError)(
                f"the API server refused the rollout Job: {exc.status} {exc.reason}: {str(exc.body)[:500]}")
        except OSError as exc:  # urllib3's connection errors are OSErrors
            err = KubernetesAPIError(f"cannot reach the Kubernetes API server: {exc}")
        return RolloutOutcome(status=RolloutStatus.FAILED.value, error=f"{type(err).__name__}: {err}",
                              error_types=tuple(type_names(type(err))), duration_s=time.monotonic() - t0,
                              ended_by_controller=True)

    async def _wait(self, tracked: _Tracked) -> Verdict:
        deadline = tracked.deadline_s
        end = None if deadline is None else time.monotonic() + deadline + self.backstop_s
        settle_end: float | None = None
        while True:
            tracked.changed.clear()
            with self._lock:
                verdict = judge(tracked.job_obj, tracked.pod, pod_deleted=tracked.pod_deleted)
                job_deleted = tracked.job_deleted
            if verdict.outcome is not None or verdict.from_store:
                return verdict
            if job_deleted:
                exc = PodNodeLost("the rollout Job was deleted before it finished")
                return Verdict(RolloutOutcome(status=RolloutStatus.FAILED.value, error=f"PodNodeLost: {exc}",
                                              error_types=tuple(type_names(PodNodeLost)), ended_by_controller=True))
            if verdict.settle and settle_end is None:
                settle_end = time.monotonic() + self.settle_s
            left = min(t - time.monotonic() for t in (end, settle_end) if t is not None) \
                if (end or settle_end) else None
            try:
                await asyncio.wait_for(tracked.changed.wait(), None if left is None else max(0.0, left))
            except asyncio.TimeoutError:
                if settle_end is not None and time.monotonic() >= settle_end:
                    return await self._settled(tracked)
                msg = f"TimeoutError: no end reported for the rollout Job {self.backstop_s:g}s past its deadline"
                return Verdict(RolloutOutcome(status=RolloutStatus.TIMEOUT.value, error=msg,
                                              error_types=tuple(type_names(TimeoutError)), ended_by_controller=True),
                               delete_job=True)

    async def _settled(self, tracked: _Tracked) -> Verdict:
        """The Job failed and its pod's end never arrived by the watch: read the pod once, then judge."""
        sel = f"{tracked.label}={tracked.key}"
        try:
            pods = (await self._call(self._core.list_namespaced_pod, self.namespace, label_selector=sel)).items
        except Exception as exc:  # noqa: BLE001 - judge from what the watch delivered
            log.warning("reading the pod of Job %s failed: %s", tracked.name, exc)
            pods = []
        pod = self._api.sanitize_for_serialization(pods[0]) if pods else tracked.pod
        return judge(tracked.job_obj, pod, pod_deleted=tracked.pod_deleted or not pods, final=True)

    async def _conclude(self, tracked: _Tracked, verdict: Verdict, t0: float) -> RolloutOutcome:
        job = tracked.jobs[0]
        outcome = verdict.outcome
        # A pod that fails after its worker ended the rollout succeeded (an OOM kill in its teardown)
        # comes back ended_by_controller: the controller keeps the stored outcome (_end_in_store).
        if verdict.needs_logs and verdict.pod_name:
            outcome = await self._with_logs(tracked, verdict)
        elif outcome is None:  # ended cleanly without a termination message: read what the worker stored
            outcome = await self._call(self._outcome_from_store, job)
        if verdict.delete_job:
            await self._call(self._delete_job, tracked.name)
        if outcome.ended_by_controller or not outcome.duration_s:
            outcome = replace(outcome, duration_s=time.monotonic() - t0)
        return self._sandbox_limit(outcome)

    def _sandbox_limit(self, outcome: RolloutOutcome) -> RolloutOutcome:
        """Under a `Sandbox`, the pod's limits are the sandbox's, as on one machine: its memory limit's
        OOM kill and the rollout's deadline are `sandbox_limit` breaches (failed, timeout), never retried."""
        sb = self.template.sandbox
        if sb is None or breach_in(outcome.error_types) is not None:
            return outcome
        oom = sb.memory_bytes is not None and any(t.endswith("PodOOMKilled") for t in outcome.error_types)
        if not oom and outcome.status != RolloutStatus.TIMEOUT.value:
            return outcome
        return replace(outcome, error=f"{SandboxLimit.kind}: {outcome.error}",
                       error_types=tuple(type_names(SandboxLimit)))

    async def _conclude_batch(self, tracked: _Tracked, verdict: Verdict, t0: float) -> list[RolloutOutcome]:
        """A batch's end: what its pod reported finished, then the store for what the message lacks
        (cut to fit, or the pod gone), then the pod's verdict for the rest (k8s_batch.assign)."""
        job_outcome = verdict.outcome
        if verdict.needs_logs and verdict.pod_name:
            job_outcome = await self._with_logs(tracked, verdict)
        if verdict.delete_job:
            await self._call(self._delete_job, tracked.name)
        pod = verdict.pod_name or ((tracked.pod or {}).get("metadata") or {}).get("name")
        done, running = parse_batch_message(termination_message(tracked.pod), pod)
        missing = [j for j in tracked.jobs if j.rollout_id not in done]
        if missing:
            stored, in_store_running = await self._call(self._stored_outcomes, missing)
            done.update(stored)
            running = running or in_store_running
        outcomes = assign(tracked.jobs, done, running, job_outcome, pod)
        took = time.monotonic() - t0
        return [replace(o, duration_s=took) if o.ended_by_controller or not o.duration_s else o for o in outcomes]

    def _stored_outcomes(self, jobs: list[RolloutJob]) -> tuple[dict[str, RolloutOutcome], list[str]]:
        """The rollouts of `jobs` the store has ended (no error types: a retry policy cannot match
        those), and those it still has running (the ones the pod was on)."""
        self._store.flush(5.0)
        done: dict[str, RolloutOutcome] = {}
        running = []
        for job in jobs:
            found = self._store.get_rollout(job.rollout_id)
            if found is not None and found.status != RolloutStatus.RUNNING:
                done[job.rollout_id] = RolloutOutcome(status=found.status.value, reward=found.final_reward,
                                                      error=found.error, duration_s=found.duration_s or 0.0)
            elif found is not None:
                running.append(job.rollout_id)
        return done, running

    async def _with_logs(self, tracked: _Tracked, verdict: Verdict) -> RolloutOutcome:
        """A non-zero exit: the pod's last log lines go into the error (unless the Job hit its deadline,
        which kills the pod too: then it is a timeout)."""
        from kubernetes.client import ApiException

        assert verdict.outcome is not None and verdict.pod_name is not None
        try:
            fresh = await self._call(self._batch.read_namespaced_job, tracked.name, self.namespace)
            again = judge(self._api.sanitize_for_serialization(fresh), None)
            if again.outcome is not None and again.outcome.status == RolloutStatus.TIMEOUT.value:
                return again.outcome
        except ApiException:
            pass
        try:
            tail = await self._call(self._core.read_namespaced_pod_log, verdict.pod_name, self.namespace,
                                    tail_lines=self.log_lines)
        except ApiException as exc:  # the pod is gone: the termination message has the log's end
            term = (((tracked.pod or {}).get("status") or {}).get("containerStatuses") or [{}])[0]
            tail = ((term.get("state") or {}).get("terminated") or {}).get("message") or f"(no logs: {exc.status})"
        text = str(tail).rstrip()[-4000:]
        return replace(verdict.outcome, error=f"{verdict.outcome.error}; last log lines:\n{text}")

    def _outcome_from_store(self, job: RolloutJob) -> RolloutOutcome:
        done, _ = self._stored_outcomes([job])
        if job.rollout_id in done:
            return done[job.rollout_id]
        exc = WorkerLost(f"the rollout pod ended without ending rollout {job.rollout_id} in the store")
        return RolloutOutcome(status=RolloutStatus.FAILED.value, error=f"WorkerLost: {exc}",
                              error_types=tuple(type_names(WorkerLost)), ended_by_controller=True)

    def _delete_job(self, name: str) -> None:
        from kubernetes.client import ApiException

        try:
            self._batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                log.warning("deleting the rollout Job %s failed: %s", name, exc)
