"""The Kubernetes API client the backend and `lightning-mw k8s reap` use (the official `kubernetes`
client, imported when called), the agent reference a pod imports, and orphan reaping by label."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from typing import Any

from lightning_middleware.controller.backends.k8s_template import (
    MANAGED_BY,
    MANAGER,
    ROLLOUT_LABEL,
    ROLLOUTS_ANNOTATION,
    RUN_LABEL,
)
from lightning_middleware.controller.execution import AgentFn
from lightning_middleware.controller.jobs import WorkerLost
from lightning_middleware.store import TraceStore


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


def job_rollout_ids(job: dict[str, Any]) -> list[str]:
    """The rollouts a Job runs: its rollout label, or a batch Job's annotation (a JSON list)."""
    meta = job.get("metadata") or {}
    listed = (meta.get("annotations") or {}).get(ROLLOUTS_ANNOTATION)
    if listed:
        try:
            return [str(r) for r in json.loads(listed)]
        except ValueError:
            return []
    rid = (meta.get("labels") or {}).get(ROLLOUT_LABEL)
    return [rid] if rid else []


def reap_jobs(namespace: str, *, api: Any = None, store: TraceStore | None = None, older_than_s: float = 300.0,
              run_id: str | None = None, dry_run: bool = False) -> list[str]:
    """Delete orphaned rollout Jobs (label managed-by=lightning-middleware) in `namespace`; their names.

    With `run_id`, every Job of that run. Otherwise Jobs created more than `older_than_s` ago none of
    whose rollouts has a lease heartbeat newer than that in `store` (its controller is gone); without
    a store, every such old Job.
    """
    from kubernetes import client

    api = api or api_client()
    batch = client.BatchV1Api(api)
    sel = f"{MANAGED_BY}={MANAGER}" + (f",{RUN_LABEL}={run_id}" if run_id else "")
    jobs = [api.sanitize_for_serialization(j) for j in batch.list_namespaced_job(namespace, label_selector=sel).items]
    now = time.time()
    old = [j for j in jobs if run_id or now - _created(j) >= older_than_s]
    if store is not None and not run_id:
        ids = [job_rollout_ids(j) for j in old]
        beats = store.lease_heartbeats([r for group in ids for r in group])
        old = [j for j, group in zip(old, ids) if now - max((beats.get(r, 0.0) for r in group), default=0.0)
               >= older_than_s]
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
