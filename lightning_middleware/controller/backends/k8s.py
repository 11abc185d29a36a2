"""Rollouts as Kubernetes Jobs, one per rollout, through the official `kubernetes` client (the `k8s`
extra), imported when the backend starts, never by the light core's import path.

Each Job runs the pod template's image with the worker entrypoint (`lightning-mw rollouts worker`),
which runs the agent exactly as a local worker process would and reaches the store by its URL.
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
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from lightning_middleware.controller.backends.k8s_status import PodNodeLost, Verdict, judge
from lightning_middleware.controller.backends.k8s_template import (
    MANAGED_BY,
    MANAGER,
    ROLLOUT_LABEL,
    RUN_LABEL,
    PodTemplate,
    active_deadline_s,
    job_manifest,
    job_name,
    network_policy,
    run_selector,
)
from lightning_middleware.controller.execution import AgentFn
from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome, WorkerLost, type_names
from lightning_middleware.records import Mode, Rollout, RolloutStatus
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)


class KubernetesAPIError(WorkerLost):
    """The API server could not be reached or failed (5xx): retried as an infrastructure error."""


def agent_reference(agent: AgentFn | str) -> str:
    """A pod imports the agent: "module:function" (a module-level function is turned into one)."""
    if isinstance(agent, str):
        return agent
    module, name = getattr(agent, "__module__", None), getattr(agent, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError("the k8s backend needs an importable agent: 'package.module:function' "
                         f"or a module-level function, not {agent!r}")
    return f"{module}:{name}"


def api_client(*, api_url: str | None = None, kubeconfig: str | None = None, context: str | None = None,
               pool_size: int = 16) -> Any:
    """A kubernetes ApiClient: `api_url` (no auth, e.g. the emulator or `kubectl proxy`), else the
    kubeconfig (`kubeconfig`, $KUBECONFIG or ~/.kube/config), else the in-cluster service account."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if api_url:
        cfg.host = api_url
    elif kubeconfig or os.environ.get("KUBECONFIG") or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = pool_size
    return client.ApiClient(cfg)


@dataclass
class _Tracked:
    job: RolloutJob
    loop: asyncio.AbstractEventLoop
    changed: asyncio.Event
    job_obj: dict[str, Any] | None = None
    pod: dict[str, Any] | None = None
    pod_deleted: bool = False
    job_deleted: bool = False
    names: list[str] = field(default_factory=list)


class KubernetesBackend:
    """One Kubernetes Job per rollout, in `template.namespace`.

    `max_jobs`: at most this many of this run's Jobs exist at once (the controller's concurrency
    limit applies too). `network_policy`: create the sandbox NetworkPolicy at start (the template's
    `sandbox.egress_to`); usually it is part of the manifests instead. `backstop_s`: past the Job's
    deadline, the controller stops waiting for the cluster and deletes the Job itself. `close()`
    deletes the run's Jobs: leaving `with RolloutController(...)` on Ctrl-C does it, and
    `lightning-mw rollouts run` turns SIGTERM into Ctrl-C (in your own program:
    `signal.signal(signal.SIGTERM, signal.default_int_handler)`).
    """

    name = "k8s"
    out_of_process = True

    def __init__(self, template: PodTemplate, *, api_url: str | None = None, kubeconfig: str | None = None,
                 context: str | None = None, run_id: str | None = None, max_jobs: int | None = None,
                 api_threads: int = 16, log_lines: int = 20, network_policy: bool = False,
                 backstop_s: float = 30.0, watch_timeout_s: int = 60, start_timeout_s: float = 30.0,
                 settle_s: float = 5.0) -> None:
        self.template = template
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
                left = [t.job for t in self._tracked.values()]
            for job in left:
                self._end_in_store(job, "failed", "cancelled: the controller stopped and deleted the rollout's Job")
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        rid = ((obj.get("metadata") or {}).get("labels") or {}).get(ROLLOUT_LABEL)
        with self._lock:
            tracked = self._tracked.get(rid or "")
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
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_jobs or 1_000_000), loop
        async with self._slots:
            t0 = time.monotonic()
            tracked = _Tracked(job, loop, asyncio.Event())
            with self._lock:
                self._tracked[job.rollout_id] = tracked
            try:
                manifest = job_manifest(self.template, job, run_id=self.run_id, agent_ref=self._agent_ref)
                refused = await self._create(manifest, t0)
                if refused is not None:
                    return refused
                verdict = await self._wait(tracked)
                return await self._conclude(tracked, verdict, t0)
            except asyncio.CancelledError:
                await asyncio.shield(self._call(self._delete_job, job.rollout_id))
                raise
            finally:
                with self._lock:
                    self._tracked.pop(job.rollout_id, None)

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
        deadline = active_deadline_s(self.template, tracked.job.timeout_s)
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
        sel = f"{ROLLOUT_LABEL}={tracked.job.rollout_id}"
        try:
            pods = (await self._call(self._core.list_namespaced_pod, self.namespace, label_selector=sel)).items
        except Exception as exc:  # noqa: BLE001 - judge from what the watch delivered
            log.warning("reading the pod of rollout %s failed: %s", tracked.job.rollout_id, exc)
            pods = []
        pod = self._api.sanitize_for_serialization(pods[0]) if pods else tracked.pod
        return judge(tracked.job_obj, pod, pod_deleted=tracked.pod_deleted or not pods, final=True)

    async def _conclude(self, tracked: _Tracked, verdict: Verdict, t0: float) -> RolloutOutcome:
        job = tracked.job
        outcome = verdict.outcome
        if verdict.needs_logs and verdict.pod_name:
            outcome = await self._with_logs(tracked, verdict)
        elif outcome is None:  # ended cleanly without a termination message: read what the worker stored
            outcome = await self._call(self._outcome_from_store, job)
        if verdict.delete_job:
            await self._call(self._delete_job, job.rollout_id)
        if outcome.ended_by_controller or not outcome.duration_s:
            outcome = replace(outcome, duration_s=time.monotonic() - t0)
        return outcome

    async def _with_logs(self, tracked: _Tracked, verdict: Verdict) -> RolloutOutcome:
        """A non-zero exit: the pod's last log lines go into the error (unless the Job hit its deadline,
        which kills the pod too: then it is a timeout)."""
        from kubernetes.client import ApiException

        assert verdict.outcome is not None and verdict.pod_name is not None
        try:
            fresh = await self._call(self._batch.read_namespaced_job, job_name(self.template, tracked.job.rollout_id),
                                     self.namespace)
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
        self._store.flush(5.0)
        found = self._store.get_rollout(job.rollout_id)
        if found is None or found.status == RolloutStatus.RUNNING:
            exc = WorkerLost(f"the rollout pod ended without ending rollout {job.rollout_id} in the store")
            return RolloutOutcome(status=RolloutStatus.FAILED.value, error=f"WorkerLost: {exc}",
                                  error_types=tuple(type_names(WorkerLost)), ended_by_controller=True)
        return RolloutOutcome(status=found.status.value, reward=found.final_reward, error=found.error,
                              duration_s=found.duration_s or 0.0)

    def _delete_job(self, rollout_id: str) -> None:
        from kubernetes.client import ApiException

        try:
            self._batch.delete_namespaced_job(job_name(self.template, rollout_id), self.namespace,
                                              propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                log.warning("deleting the Job of rollout %s failed: %s", rollout_id, exc)


def reap_jobs(namespace: str, *, api: Any = None, store: TraceStore | None = None, older_than_s: float = 300.0,
              run_id: str | None = None, dry_run: bool = False) -> list[str]:
    """Delete orphaned rollout Jobs (label managed-by=lightning-middleware) in `namespace`; their names.

    With `run_id`, every Job of that run. Otherwise Jobs created more than `older_than_s` ago whose
    rollout has no lease heartbeat newer than that in `store` (its controller is gone); without a
    store, every such old Job.
    """
    from kubernetes import client

    api = api or api_client()
    batch = client.BatchV1Api(api)
    sel = f"{MANAGED_BY}={MANAGER}" + (f",{RUN_LABEL}={run_id}" if run_id else "")
    jobs = [api.sanitize_for_serialization(j) for j in batch.list_namespaced_job(namespace, label_selector=sel).items]
    now = time.time()
    old = [j for j in jobs if run_id or now - _created(j) >= older_than_s]
    if store is not None and not run_id:
        ids = [j["metadata"]["labels"].get(ROLLOUT_LABEL, "") for j in old]
        beats = store.lease_heartbeats(ids)
        old = [j for j, rid in zip(old, ids) if now - beats.get(rid, 0.0) >= older_than_s]
    names = [j["metadata"]["name"] for j in old]
    for name in [] if dry_run else names:
        try:
            batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        except client.ApiException as exc:
            if exc.status != 404:
                raise
    return names


def _created(job: dict[str, Any]) -> float:
    stamp = (job.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return time.time()
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()
