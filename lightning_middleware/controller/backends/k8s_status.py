"""How a rollout Job ended, read from the Job and Pod objects the API server reports (plain dicts).

Infrastructure failures (the image could not be pulled, the container was OOM-killed, the pod was
evicted or lost with its node) are `WorkerLost` subclasses, so the controller's `RetryPolicy`
retries them by default; the Job's deadline is a timeout; an agent process that exits non-zero
fails the rollout with its last log lines. A worker that exits 0 wrote its outcome to the
container's termination message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from lightning_middleware.controller.jobs import RolloutOutcome, WorkerLost, type_names
from lightning_middleware.records import RolloutStatus

# Waiting reasons after which a container never starts without someone fixing the pod spec or registry.
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                                "CreateContainerConfigError", "CreateContainerError"})


class PodImagePullFailed(WorkerLost):
    """The rollout container's image could not be pulled (or its container could not be created)."""


class PodOOMKilled(WorkerLost):
    """The rollout container went over its memory limit and was killed."""


class PodEvicted(WorkerLost):
    """The rollout pod was evicted or preempted (node pressure, the eviction API, a higher priority)."""


class PodNodeLost(WorkerLost):
    """The rollout pod's node went away (or the pod was deleted) before it finished."""


class AgentExited(RuntimeError):
    """The rollout container exited non-zero without reporting an outcome (the agent's process died)."""


@dataclass(frozen=True)
class Verdict:
    """What one Job's state means. `outcome` None: not ended yet. `needs_logs`: the error should carry
    the pod's last log lines (the backend reads them). `delete_job`: the Job will not end on its own."""

    outcome: RolloutOutcome | None
    needs_logs: bool = False
    delete_job: bool = False
    pod_name: str | None = None
    from_store: bool = False  # ended cleanly without a termination message: the store row has the outcome
    settle: bool = False  # the Job ended but its pod's final state has not been seen yet: wait for it


PENDING = Verdict(None)


def _lost(exc: BaseException, worker: str | None, *, delete: bool = False, status: str = "failed") -> Verdict:
    outcome = RolloutOutcome(status=status, error=f"{type(exc).__name__}: {exc}",
                             error_types=tuple(type_names(type(exc))), worker=worker, ended_by_controller=True)
    return Verdict(outcome, delete_job=delete, pod_name=worker)


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return dict(cond)
    return None


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return dict(statuses[0]) if statuses else {}


def parse_outcome(message: str | None, worker: str | None) -> RolloutOutcome | None:
    """The worker's termination message: the RolloutOutcome it reported, as JSON."""
    if not message:
        return None
    try:
        data = json.loads(message.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    if not isinstance(data, dict) or "status" not in data:
        return None
    names = {f.name for f in fields(RolloutOutcome)}
    data = {k: v for k, v in data.items() if k in names}
    data["error_types"] = tuple(data.get("error_types") or ())
    data["worker"] = data.get("worker") or worker
    return RolloutOutcome(**data)


def _deadline(job: dict[str, Any] | None) -> Verdict | None:
    for kind in ("FailureTarget", "Failed"):
        cond = _condition(job, kind)
        if cond is not None and cond.get("reason") == "DeadlineExceeded":
            deadline = ((job or {}).get("spec") or {}).get("activeDeadlineSeconds")
            return _lost(TimeoutError(f"the rollout Job ran past its activeDeadlineSeconds ({deadline}s)"),
                         None, status=RolloutStatus.TIMEOUT.value)
    return None


def _from_pod(pod: dict[str, Any]) -> Verdict | None:
    name = (pod.get("metadata") or {}).get("name")
    status = pod.get("status") or {}
    state = _container(pod).get("state") or {}
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in IMAGE_PULL_REASONS:
        image = _container(pod).get("image") or "?"
        return _lost(PodImagePullFailed(f"pod {name}: {waiting['reason']} for image {image}: "
                                        f"{waiting.get('message', '')}".rstrip(": ")), name, delete=True)
    disruption = _condition(pod, "DisruptionTarget")
    if status.get("reason") == "Evicted" or (disruption and "Eviction" in str(disruption.get("reason"))) or (
            disruption and "Preemption" in str(disruption.get("reason"))):
        why = status.get("message") or (disruption or {}).get("message") or "evicted"
        return _lost(PodEvicted(f"pod {name} was evicted: {why}"), name)
    if status.get("reason") == "NodeLost" or disruption is not None:
        why = status.get("message") or (disruption or {}).get("reason") or "node lost"
        return _lost(PodNodeLost(f"pod {name} lost its node: {why}"), name)
    term = state.get("terminated")
    if not term:
        return None
    if term.get("reason") == "OOMKilled":
        limit = (((pod.get("spec") or {}).get("containers") or [{}])[0].get("resources") or {}).get("limits", {})
        return _lost(PodOOMKilled(f"pod {name} was OOM-killed (memory limit {limit.get('memory', 'none')})"), name)
    code = term.get("exitCode")
    if code == 0:
        outcome = parse_outcome(term.get("message"), name)
        return Verdict(outcome, pod_name=name) if outcome is not None else Verdict(None, pod_name=name, from_store=True)
    exc = AgentExited(f"pod {name} exited with code {code} ({term.get('reason') or 'Error'})")
    outcome = RolloutOutcome(status=RolloutStatus.FAILED.value, error=f"AgentExited: {exc}",
                             error_types=tuple(type_names(AgentExited)), worker=name, ended_by_controller=True)
    return Verdict(outcome, needs_logs=True, pod_name=name)


def judge(job: dict[str, Any] | None, pod: dict[str, Any] | None, *, pod_deleted: bool = False,
          final: bool = False) -> Verdict:
    """The verdict for one rollout from its Job and its (only) Pod as last seen. Jobs and Pods are
    watched separately, so a Job's end can arrive before its pod's: unless `final`, that asks to
    `settle` (wait for the pod) rather than guess."""
    timed_out = _deadline(job)
    if timed_out is not None:
        return timed_out  # before the pod: the Job controller kills the pod at the deadline
    if pod is not None:
        found = _from_pod(pod)
        if found is not None:
            return found
        if pod_deleted and not final:
            return Verdict(None, settle=True)  # the Job controller deletes pods at the deadline: wait for the Job
        if pod_deleted:
            name = (pod.get("metadata") or {}).get("name")
            return _lost(PodNodeLost(f"pod {name} was deleted before it finished"), name)
    if _condition(job, "Complete") is not None or _condition(job, "SuccessCriteriaMet") is not None:
        if not final:
            return Verdict(None, settle=True)  # the pod's termination message is on its way
        return Verdict(None, pod_name=((pod or {}).get("metadata") or {}).get("name"), from_store=True)
    failed = _condition(job, "Failed")
    if failed is not None and not final:
        return Verdict(None, settle=True)
    if failed is not None:
        return _lost(PodNodeLost(f"the rollout Job failed: {failed.get('reason')}: {failed.get('message', '')}"),
                     None)
    return PENDING


def job_complete(job: dict[str, Any] | None) -> bool:
    return _condition(job, "Complete") is not None
