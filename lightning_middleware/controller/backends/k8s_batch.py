"""Several rollouts per Kubernetes Job (`KubernetesBackend(rollouts_per_job=N)`): how rollouts are
gathered into batches, what a batch's pod reports, and how a batch's end becomes one outcome per
rollout. Pure asyncio and JSON, no Kubernetes client (the worker in the pod imports this too).

The pod runs its rollouts one after another (each with its own timeout, the worker's SIGALRM), or
up to `pod_concurrency` at once, and rewrites its termination message as each starts and ends: the
outcomes so far and the rollouts now running. A pod killed mid-batch (OOM, eviction, a lost node)
so still reports what finished; the rollouts it was running get the pod's verdict, the ones it never
started are `BatchCutShort` (retried).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome, WorkerLost, type_names
from lightning_middleware.records import RolloutStatus

MESSAGE_LIMIT = 4096  # bytes: what the kubelet keeps of a container's termination message
_OUTCOME_FIELDS = {f.name for f in fields(RolloutOutcome)}
Launch = Callable[[list[RolloutJob]], Awaitable[list[RolloutOutcome]]]


class BatchCutShort(WorkerLost):
    """The batch's pod ended (killed, evicted, its agent process died) before this rollout started."""


# -- what the pod reports ----------------------------------------------------------------
def batch_message(done: dict[str, RolloutOutcome], running: list[str], limit: int = MESSAGE_LIMIT) -> str:
    """The termination message: `{"batch": {rollout id: outcome}, "running": [ids]}` within `limit` bytes.
    Error texts are shortened first, then the oldest outcomes dropped (the controller reads those
    from the store, which has them: the worker flushes before it reports)."""
    items = {rid: _compact(o) for rid, o in done.items()}
    for cut in (None, 400, 120, 40):
        if cut is not None:
            for d in items.values():
                if d.get("error"):
                    d["error"] = d["error"][:cut]
        text = json.dumps({"batch": items, "running": running}, separators=(",", ":"))
        if len(text.encode()) <= limit:
            return text
    while items:
        items.pop(next(iter(items)))
        text = json.dumps({"batch": items, "running": running}, separators=(",", ":"))
        if len(text.encode()) <= limit:
            return text
    return json.dumps({"batch": {}, "running": running})


def _compact(outcome: RolloutOutcome) -> dict[str, Any]:
    data = {k: v for k, v in asdict(outcome).items() if v not in (None, (), [], False) and k != "worker"}
    data["duration_s"] = round(outcome.duration_s, 3)
    return data


def termination_message(pod: dict[str, Any] | None) -> str | None:
    """What the pod's container wrote to its termination-message file (the batch's report)."""
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or [{}]
    return ((statuses[0].get("state") or {}).get("terminated") or {}).get("message")


def parse_batch_message(message: str | None, worker: str | None) -> tuple[dict[str, RolloutOutcome], list[str]]:
    """The outcomes a batch's pod reported and the rollouts it was running; ({}, []) if none."""
    if not message:
        return {}, []
    try:
        data = json.loads(message.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}, []
    if not isinstance(data, dict) or not isinstance(data.get("batch"), dict):
        return {}, []
    done = {}
    for rid, item in data["batch"].items():
        if isinstance(item, dict) and "status" in item:
            item = {k: v for k, v in item.items() if k in _OUTCOME_FIELDS}
            done[rid] = RolloutOutcome(**{**item, "error_types": tuple(item.get("error_types") or ()),
                                          "worker": worker})
    running = data.get("running")
    return done, [str(r) for r in running] if isinstance(running, list) else []


# -- one outcome per rollout -------------------------------------------------------------
def assign(jobs: list[RolloutJob], done: dict[str, RolloutOutcome], running: list[str],
           job_outcome: RolloutOutcome | None, worker: str | None) -> list[RolloutOutcome]:
    """Every rollout of a batch: its own outcome if it finished; the pod's verdict (`job_outcome`)
    for those it was running (or the first not finished, if none is known to have run); BatchCutShort
    for those it never started. A pod that exited cleanly without ending a rollout: WorkerLost."""
    unfinished = [j.rollout_id for j in jobs if j.rollout_id not in done]
    # Known to be running (the message or the store says so): they get the verdict, even if all of
    # them finished after all; nothing known: the first not finished (it was starting, or never could).
    hit = {r for r in running if r in unfinished} if running else set(unfinished[:1])
    why = job_outcome.error if job_outcome is not None else None
    out = []
    for job in jobs:
        rid = job.rollout_id
        if rid in done:
            out.append(done[rid])
        elif rid in hit and job_outcome is not None:
            out.append(job_outcome)
        elif job_outcome is None:
            out.append(_lost(WorkerLost(f"the rollout pod ended without ending rollout {rid} in the store"), worker))
        else:
            pod = f"pod {worker}" if worker else "pod"
            exc = BatchCutShort(f"rollout {rid} never started: its batch's {pod} ended first ({why})")
            out.append(_lost(exc, worker))
    return out


def _lost(exc: WorkerLost, worker: str | None) -> RolloutOutcome:
    return RolloutOutcome(status=RolloutStatus.FAILED.value, error=f"{type(exc).__name__}: {exc}",
                          error_types=tuple(type_names(type(exc))), worker=worker, ended_by_controller=True)


# -- gathering rollouts into batches -----------------------------------------------------
@dataclass
class _Batch:
    waiting: int
    task: asyncio.Task[None] | None = None


@dataclass
class Batcher:
    """Gathers the rollouts the controller hands over (`submit`) into batches of up to `size`: a batch
    leaves when it is full or `linger_s` after its first rollout arrived, and `launch` runs it (one
    Job). Rollouts that arrive together (a group's `n` samples) so share a Job. A cancelled rollout
    leaves its batch if it has not left yet; a batch whose every rollout was cancelled is cancelled
    (`launch` then deletes its Job)."""

    size: int
    linger_s: float
    launch: Launch
    loop: asyncio.AbstractEventLoop
    _open: list[tuple[RolloutJob, asyncio.Future[RolloutOutcome]]] = field(default_factory=list)
    _timer: asyncio.TimerHandle | None = None
    _of: dict[str, _Batch] = field(default_factory=dict)

    async def submit(self, job: RolloutJob) -> RolloutOutcome:
        fut: asyncio.Future[RolloutOutcome] = self.loop.create_future()
        self._open.append((job, fut))
        if len(self._open) >= self.size:
            self._flush()
        elif self._timer is None:
            self._timer = self.loop.call_later(self.linger_s, self._flush)
        try:
            return await fut
        except asyncio.CancelledError:
            abandoned = self._leave(job, fut)
            if abandoned is not None:  # the last of its batch: wait until its Job is deleted
                await asyncio.gather(abandoned, return_exceptions=True)
            raise
        finally:
            self._of.pop(job.rollout_id, None)

    def _leave(self, job: RolloutJob, fut: asyncio.Future[RolloutOutcome]) -> asyncio.Task[None] | None:
        """Take a cancelled rollout out of its batch; the batch's task if that cancelled it."""
        if any(f is fut for _, f in self._open):
            self._open = [(j, f) for j, f in self._open if f is not fut]
            return None
        batch = self._of.get(job.rollout_id)
        if batch is None:
            return None
        batch.waiting -= 1
        if batch.waiting > 0 or batch.task is None:
            return None
        batch.task.cancel()
        return batch.task

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        members, self._open = self._open, []
        if not members:
            return
        batch = _Batch(waiting=len(members))
        for job, _ in members:
            self._of[job.rollout_id] = batch
        batch.task = self.loop.create_task(self._run(members))

    async def _run(self, members: list[tuple[RolloutJob, asyncio.Future[RolloutOutcome]]]) -> None:
        try:
            outcomes = await self.launch([job for job, _ in members])
        except asyncio.CancelledError:
            for _, fut in members:
                fut.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each rollout's controller reports it as a backend failure
            for _, fut in members:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), outcome in zip(members, outcomes):
            if not fut.done():
                fut.set_result(outcome)
