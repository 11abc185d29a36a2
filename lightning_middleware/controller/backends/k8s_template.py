"""What a rollout's Kubernetes Job looks like: the user's pod template, the sandbox options for coding
agents, and the Job / NetworkPolicy objects built from them (plain dicts, as the API takes them).

Pure functions, no Kubernetes client: the backend (k8s.py) and `lightning-mw k8s manifests` both
render from here, and the tests validate the output against the Kubernetes OpenAPI schemas.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_middleware.controller.jobs import RolloutJob
from lightning_middleware.controller.sandbox import Sandbox
from lightning_middleware.controller.sandbox_entry import ENV_SANDBOX, ENV_SANDBOX_WORKSPACE

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "lightning-middleware"
ROLE_LABEL = "lightning-middleware/role"
RUN_LABEL = "lightning-middleware/run"
ROLLOUT_LABEL = "lightning-middleware/rollout"
BATCH_LABEL = "lightning-middleware/batch"  # a Job running several rollouts (rollouts_per_job > 1)
TASK_ANNOTATION = "lightning-middleware/task-id"
ROLLOUTS_ANNOTATION = "lightning-middleware/rollouts"  # a batch Job's rollout ids, a JSON list, in order
# What the worker entrypoint (controller/worker.py) reads from its environment.
ENV_AGENT = "LIGHTNING_AGENT"
ENV_JOB = "LIGHTNING_ROLLOUT_JOB"
ENV_JOBS = "LIGHTNING_ROLLOUT_JOBS"  # a batch: the RolloutJobs as a JSON list, run in that order
ENV_CONCURRENCY = "LIGHTNING_ROLLOUT_CONCURRENCY"  # a batch's rollouts at once in the pod (default 1)
ENV_STORE = "LIGHTNING_STORE_URL"
ENV_GATEWAY = "LIGHTNING_GATEWAY_URL"  # a pod that reaches only the gateway (no store URL)
ENV_ROLLOUT_ID = "LIGHTNING_ROLLOUT_ID"
ENV_TERMINATION_LOG = "LIGHTNING_TERMINATION_LOG"
DEFAULT_COMMAND = ("lightning-mw", "rollouts", "worker")
_NAME_OK = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class PodTemplate:
    """The pod a rollout runs in: the same worker entrypoint a local process runs, in your image.

    `store_url`: the store as the pods reach it (a cluster DNS name); default: the controller's.
    `store_url_secret`: (secret name, key) holding that URL, so no password lands in the Job object.
    `gateway_url`: the gateway as the pods reach it, when they reach only the gateway
    (`KubernetesBackend(gateway=...)`); default: the backend's gateway URL.
    `startup_grace_s`: added to the rollout timeout for `activeDeadlineSeconds` (scheduling, image
    pull, imports); the worker's own alarm ends the rollout at the timeout itself.
    """

    image: str
    namespace: str = "default"
    command: tuple[str, ...] = DEFAULT_COMMAND
    env: dict[str, str] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    service_account: str | None = None
    image_pull_policy: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    store_url: str | None = None
    store_url_secret: tuple[str, str] | None = None
    gateway_url: str | None = None
    ttl_seconds_after_finished: int = 600
    startup_grace_s: float = 60.0
    name_prefix: str = "rollout"
    sandbox: Sandbox | None = None

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("the pod template needs an image")
        if not _NAME_OK.match(self.name_prefix) or len(self.name_prefix) > 20:
            raise ValueError(f"name_prefix {self.name_prefix!r} must be a DNS label of at most 20 characters")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PodTemplate:
        """From a TOML/JSON/YAML table; unknown keys are an error that names them."""
        data = dict(data)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown pod template keys {unknown}; known: {sorted(known)}")
        if isinstance(data.get("sandbox"), dict):
            data["sandbox"] = Sandbox.from_dict(data["sandbox"])
        for key in ("command", "store_url_secret"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def load_template(path: str, **overrides: Any) -> PodTemplate:
    """A pod template from a TOML or JSON file (a `[pod]` table, or the whole file); a bad file or key
    is a UsageError that names it."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    from lightning_middleware.errors import UsageError

    try:
        with open(path, "rb") as f:
            data = json.load(f) if path.endswith(".json") else tomllib.load(f)
        table = dict(data.get("pod", data))
        table.update({k: v for k, v in overrides.items() if v is not None})
        return PodTemplate.from_dict(table)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"pod template {path}: {exc}") from None


def job_name(template: PodTemplate, rollout_id: str) -> str:
    return f"{template.name_prefix}-{rollout_id}"[:63].rstrip("-")


def batch_job_name(template: PodTemplate, batch_id: str) -> str:
    return f"{template.name_prefix}-batch-{batch_id}"[:63].rstrip("-")


def run_selector(run_id: str) -> str:
    return f"{MANAGED_BY}={MANAGER},{RUN_LABEL}={run_id}"


def rollout_labels(template: PodTemplate, run_id: str, rollout_id: str | None = None) -> dict[str, str]:
    labels = {**template.labels, MANAGED_BY: MANAGER, ROLE_LABEL: "rollout", RUN_LABEL: run_id}
    if rollout_id is not None:
        labels[ROLLOUT_LABEL] = rollout_id
    return labels


def active_deadline_s(template: PodTemplate, timeout_s: float | None, count: int = 1) -> int | None:
    """A Job's deadline: `count` timeouts (a batch's `batch_rounds`) plus the start-up grace."""
    return None if timeout_s is None else max(1, math.ceil(count * timeout_s + template.startup_grace_s))


def jobs_deadline_s(template: PodTemplate, jobs: list[RolloutJob], concurrency: int = 1) -> int | None:
    """The deadline of the Job that runs `jobs`: none if one of them has no timeout; else its batch's
    rounds of the longest of their timeouts (each task may have its own) plus the start-up grace."""
    timeouts = [j.timeout_s for j in jobs]
    if any(t is None for t in timeouts):
        return None
    return active_deadline_s(template, max(t or 0.0 for t in timeouts), batch_rounds(len(jobs), concurrency))


def batch_rounds(count: int, concurrency: int) -> int:
    """Timeouts a batch of `count` rollouts can take, `concurrency` at a time, each starting as a slot
    frees: the last one starts after at most (count - 1) / concurrency timeouts and runs one more."""
    return 1 + -(-(count - 1) // concurrency)


def jobs_payload(jobs: list[RolloutJob]) -> str:
    """What a pod's env carries: one job as a JSON object, a batch as a JSON list (no store URL:
    the pod has its own)."""
    for job in jobs:
        if job.rewards is not None and not isinstance(job.rewards, str):
            raise ValueError("the k8s backend takes the reward configuration as a file path, present at the same "
                             "path in the pod (a ConfigMap mount), not a RewardConfig object")
    items = [{**asdict(job), "store_url": None} for job in jobs]
    return json.dumps(items[0] if len(items) == 1 else items, separators=(",", ":"))


def _env(template: PodTemplate, jobs: list[RolloutJob], agent_ref: str,
         gateway: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    job = jobs[0]
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in template.env.items()]
    env += [{"name": ENV_AGENT, "value": agent_ref},
            {"name": ENV_JOB if len(jobs) == 1 else ENV_JOBS, "value": jobs_payload(jobs)}]
    if gateway is not None:  # no store URL: the rollout's own gateway route, and a token for it alone
        url, token = gateway[0].rstrip("/"), gateway[1]
        env += [{"name": ENV_GATEWAY, "value": url}, {"name": ENV_ROLLOUT_ID, "value": job.rollout_id},
                {"name": "OPENAI_BASE_URL", "value": f"{url}/rollouts/{job.rollout_id}/v1"},
                {"name": "OPENAI_API_KEY", "value": token}]
    elif template.store_url_secret is not None:
        name, key = template.store_url_secret
        env.append({"name": ENV_STORE, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    elif template.store_url or job.store_url:
        env.append({"name": ENV_STORE, "value": template.store_url or job.store_url})
    if template.sandbox is not None and template.sandbox.workspace_volume is not None and template.sandbox.hide_git:
        env.append({"name": "GIT_DIR", "value": "/dev/null/no-git"})
    if template.sandbox is not None:  # the worker classes a breach as the local sandbox does (execution.py)
        env += [{"name": ENV_SANDBOX, "value": "1"},
                {"name": ENV_SANDBOX_WORKSPACE, "value": template.sandbox.workspace_path}]
    return env


def _sandboxed(pod: dict[str, Any], container: dict[str, Any], sb: Sandbox) -> None:
    pod["automountServiceAccountToken"] = sb.automount_service_account_token
    sec: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                           "readOnlyRootFilesystem": sb.read_only_root_fs}
    if sb.run_as_non_root:
        sec["runAsNonRoot"] = True
    container["securityContext"] = sec
    if sb.memory_bytes is not None:  # the template's own limit wins (its resources are a copy here)
        container.setdefault("resources", {}).setdefault("limits", {}).setdefault("memory", str(sb.memory_bytes))
    volumes: list[dict[str, Any]] = [{"name": "scratch", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "scratch", "mountPath": "/tmp"}]
    if sb.workspace_volume is not None:
        volumes.append({"name": "workspace", **sb.workspace_volume})
        mounts.append({"name": "workspace", "mountPath": sb.workspace_path})
        if sb.hide_git:  # an empty, read-only directory over the repository's .git hides its history
            volumes.append({"name": "no-git", "emptyDir": {"sizeLimit": "1Mi"}})
            mounts.append({"name": "no-git", "mountPath": f"{sb.workspace_path.rstrip('/')}/.git", "readOnly": True})
    pod["volumes"] = volumes
    container["volumeMounts"] = mounts


def job_manifest(template: PodTemplate, job: RolloutJob, *, run_id: str, agent_ref: str,
                 gateway: tuple[str, str] | None = None) -> dict[str, Any]:
    """The batch/v1 Job for one rollout: backoffLimit 0 (retries are the controller's), a deadline
    from the rollout timeout, cleaned up `ttl_seconds_after_finished` after it ends. `gateway`:
    (the gateway's URL as the pod reaches it, the rollout's scoped token): the pod gets those and
    no store URL."""
    labels = rollout_labels(template, run_id, job.rollout_id)
    meta = {"name": job_name(template, job.rollout_id), "namespace": template.namespace, "labels": labels,
            "annotations": {TASK_ANNOTATION: job.task_id}}
    return _manifest(template, [job], meta, agent_ref, gateway=gateway)


def batch_manifest(template: PodTemplate, jobs: list[RolloutJob], *, run_id: str, batch_id: str,
                   agent_ref: str, concurrency: int = 1) -> dict[str, Any]:
    """The Job for a batch of rollouts run in one pod, `concurrency` at a time (in order): labelled by
    the batch, its rollout and task ids annotated (JSON lists, in run order), the deadline what its
    rollouts take at most (batch_rounds timeouts)."""
    labels = {**rollout_labels(template, run_id), BATCH_LABEL: batch_id}
    annotations = {ROLLOUTS_ANNOTATION: json.dumps([j.rollout_id for j in jobs]),
                   TASK_ANNOTATION: json.dumps([j.task_id for j in jobs])}
    meta = {"name": batch_job_name(template, batch_id), "namespace": template.namespace, "labels": labels,
            "annotations": annotations}
    return _manifest(template, jobs, meta, agent_ref, concurrency)


def _manifest(template: PodTemplate, jobs: list[RolloutJob], meta: dict[str, Any], agent_ref: str,
              concurrency: int = 1, gateway: tuple[str, str] | None = None) -> dict[str, Any]:
    labels = meta["labels"]
    env = _env(template, jobs, agent_ref, gateway)
    if concurrency > 1:
        env.append({"name": ENV_CONCURRENCY, "value": str(concurrency)})
    container: dict[str, Any] = {"name": "rollout", "image": template.image, "command": list(template.command),
                                 "env": env,
                                 "terminationMessagePath": "/dev/termination-log",
                                 "terminationMessagePolicy": "FallbackToLogsOnError"}
    if template.resources:
        container["resources"] = {k: dict(v) if isinstance(v, dict) else v for k, v in template.resources.items()}
    if template.image_pull_policy:
        container["imagePullPolicy"] = template.image_pull_policy
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if template.node_selector:
        pod["nodeSelector"] = dict(template.node_selector)
    if template.service_account:
        pod["serviceAccountName"] = template.service_account
    if template.sandbox is not None:
        _sandboxed(pod, container, template.sandbox)
    spec: dict[str, Any] = {"backoffLimit": 0, "ttlSecondsAfterFinished": template.ttl_seconds_after_finished,
                            "template": {"metadata": {"labels": labels}, "spec": pod}}
    deadline = jobs_deadline_s(template, jobs, concurrency)
    if deadline is not None:
        spec["activeDeadlineSeconds"] = deadline
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


def network_policy(name: str, namespace: str, egress_to: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """Rollout pods (role=rollout) may reach only `egress_to` and DNS; no ingress at all."""
    dns = {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
           "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    egress = [dns] + ([{"to": list(egress_to)}] if egress_to else [])
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace, "labels": {MANAGED_BY: MANAGER}},
            "spec": {"podSelector": {"matchLabels": {MANAGED_BY: MANAGER, ROLE_LABEL: "rollout"}},
                     "policyTypes": ["Ingress", "Egress"], "egress": egress}}
