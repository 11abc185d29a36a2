"""A test "kubelet" (and Job controller) for the emulated API server: each Job created there gets a
Pod, whose container command runs as a local process with the container's env; the Pod's and the
Job's status are written back as a cluster would (phases, container states, termination message,
conditions, `activeDeadlineSeconds`, `ttlSecondsAfterFinished`, deleting a pod kills its process).

    with K8sAPIServer() as api, Kubelet(api, faults=lambda job: "oom" if ... else None):
        ...

`faults(job) -> str | None` makes a pod fail as a cluster can: "image_pull" (ErrImagePull, then
ImagePullBackOff; it never starts), "oom" (killed, OOMKilled), "evict" (Failed, reason Evicted),
"node_lost" (DisruptionTarget, then the pod is deleted), "slow_start:<s>" (starts after s seconds,
like a slow image pull: the Job's deadline counts from its start), "oom_at_exit" (the container runs
to its end, then is reported OOMKilled, as when the kernel kills a process in its teardown). The pod
of an "oom", "evict" or "node_lost" fault is Running for `fault_delay_s`, its process held before it
starts the command, so the fault always lands before the rollout can end, however loaded the
machine (a loop woken late once let a fast agent finish first). `kill_pod(pid, fault)` does
"oom", "evict" or "node_lost" to the running pod whose process is `pid`, at the moment a test
chooses (mid-batch). `instant=True` runs nothing: every container "exits" 0 at once reporting
succeeded rollouts with reward 1.0 (to measure what the controller costs per Job,
bench/bench_controller_k8s.py).

Standalone, in its own process: `python -m lightning_middleware.testing.kubelet --port 8011 [--instant]`.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import signal
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_middleware.controller.backends.k8s_batch import batch_message
from lightning_middleware.controller.backends.k8s_template import ENV_JOBS
from lightning_middleware.controller.jobs import RolloutOutcome
from lightning_middleware.testing.k8s_api import K8sAPIServer, ObjectStore, now_iso

Fault = Callable[[dict[str, Any]], "str | None"]


def job_env(job: dict[str, Any]) -> dict[str, str]:
    """The plain `value` env of a Job's first container (for fault selectors in tests)."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


class Kubelet:
    def __init__(self, api: K8sAPIServer, *, faults: Fault | None = None, workdir: str | None = None,
                 fault_delay_s: float = 0.3, instant: bool = False) -> None:
        self.api = api
        self.instant = instant
        self.faults = faults
        self.workdir = workdir or os.getcwd()
        self.fault_delay_s = fault_delay_s
        self.active = 0  # pods started and not ended
        self.max_active = 0
        self.pods_started = 0
        self._procs: dict[tuple[str, str], asyncio.subprocess.Process] = {}
        self._gone: dict[tuple[str, str], asyncio.Event] = {}
        self._forced: dict[tuple[str, str], str] = {}  # kill_pod's fault for a pod
        self._tasks: set[asyncio.Task[None]] = set()
        self._tmp = tempfile.TemporaryDirectory(prefix="kubelet-")

    @property
    def store(self) -> ObjectStore:
        assert self.api.store is not None
        return self.api.store

    def __enter__(self) -> Kubelet:
        self.api.call(lambda: self.store.listeners.append(self._on_event))
        return self

    def __exit__(self, *_exc: Any) -> None:
        def stop() -> None:
            self.store.listeners.remove(self._on_event)
            for proc in self._procs.values():
                if proc.returncode is None:
                    proc.kill()
            for task in self._tasks:
                task.cancel()
        self.api.call(stop)
        self._tmp.cleanup()

    def _on_event(self, kind: str, plural: str, obj: dict[str, Any]) -> None:
        if plural == "jobs" and kind == "ADDED":
            task = asyncio.get_running_loop().create_task(self._run_job(copy.deepcopy(obj)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif plural == "pods" and kind == "DELETED":
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            if key in self._gone:
                self._gone[key].set()
            proc = self._procs.get(key)
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)  # as the kubelet does; SIGKILL after a grace period
                asyncio.get_running_loop().call_later(2.0, _kill_if_running, proc)

    def kill_pod(self, pid: int, fault: str = "evict") -> str:
        """Do `fault` ("oom", "evict", "node_lost") to the running pod whose process is `pid`, now;
        the pod's name. Thread-safe (it runs on the API server's loop)."""
        if fault not in ("oom", "evict", "node_lost"):
            raise ValueError(f"kill_pod fault must be oom, evict or node_lost, not {fault!r}")

        def kill() -> str:
            for key, proc in self._procs.items():
                if proc.pid == pid and proc.returncode is None:
                    self._forced[key] = fault
                    proc.kill()
                    return key[1]
            raise LookupError(f"no running pod has process {pid}")
        return str(self.api.call(kill))

    def _patch(self, plural: str, ns: str, name: str, patch: dict[str, Any]) -> None:
        if (plural, ns, name) in self.store.objects:  # it may have been deleted meanwhile
            self.store.patch(plural, ns, name, patch)

    # -- the Job controller ------------------------------------------------------------
    async def _run_job(self, job: dict[str, Any]) -> None:
        meta, spec = job["metadata"], job["spec"]
        ns, name = meta["namespace"], meta["name"]
        self._patch("jobs", ns, name, {"status": {"startTime": now_iso(), "active": 1}})
        tmpl = spec["template"]
        pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name[:57]}-{uuid.uuid4().hex[:5]}",
                            "labels": {**(tmpl.get("metadata", {}).get("labels") or {}), "job-name": name,
                                       "batch.kubernetes.io/job-name": name},
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                 "uid": meta["uid"], "controller": True}]},
               "spec": {**copy.deepcopy(tmpl["spec"]), "nodeName": "emulated-node"},
               "status": {"phase": "Pending"}}
        pod = self.store.create("pods", ns, pod)
        fault = self.faults(job) if self.faults else None
        task = asyncio.ensure_future(self._run_pod(ns, pod, fault))
        done, _ = await asyncio.wait({task}, timeout=spec.get("activeDeadlineSeconds"))
        if not done:  # the deadline: mark the Job, then delete its pod, as the Job controller does
            cond = {"type": "FailureTarget", "status": "True", "reason": "DeadlineExceeded",
                    "message": "Job was active longer than specified deadline"}
            self._patch("jobs", ns, name, {"status": {"conditions": [cond]}})
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if ("pods", ns, pod["metadata"]["name"]) in self.store.objects:
                self.store.delete("pods", ns, pod["metadata"]["name"])
            self._finish(ns, name, spec, [cond, {**cond, "type": "Failed"}], ok=False)
            return
        if task.result():
            conds = [{"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached"},
                     {"type": "Complete", "status": "True", "reason": "CompletionsReached"}]
            self._finish(ns, name, spec, conds, ok=True)
        else:
            cond = {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit"}
            self._finish(ns, name, spec, [cond, {**cond, "type": "Failed"}], ok=False)

    def _finish(self, ns: str, name: str, spec: dict[str, Any], conds: list[dict[str, Any]], ok: bool) -> None:
        for c in conds:
            c["lastTransitionTime"] = now_iso()
        status: dict[str, Any] = {"active": 0, "conditions": conds, "succeeded" if ok else "failed": 1}
        if ok:
            status["completionTime"] = now_iso()
        self._patch("jobs", ns, name, {"status": status})
        ttl = spec.get("ttlSecondsAfterFinished")
        if ttl is not None:
            def expire() -> None:
                if ("jobs", ns, name) in self.store.objects:
                    self.store.delete("jobs", ns, name, "Background")
            asyncio.get_running_loop().call_later(ttl, expire)

    # -- the kubelet -------------------------------------------------------------------
    def _env(self, ns: str, container: dict[str, Any], term_log: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
            elif ref := (e.get("valueFrom") or {}).get("secretKeyRef"):
                secret = self.store.objects.get(("secrets", ns, ref["name"]))
                if secret is None:
                    raise LookupError(f'secret "{ref["name"]}" not found')
                env[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        env["LIGHTNING_TERMINATION_LOG"] = term_log  # stands for the /dev/termination-log mount
        return env

    async def _run_pod(self, ns: str, pod: dict[str, Any], fault: str | None) -> bool:
        name = pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        key = (ns, name)
        self._gone[key] = asyncio.Event()
        base = {"name": container["name"], "image": container["image"], "imageID": "", "restartCount": 0}
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if fault == "image_pull":
                for reason in ("ErrImagePull", "ImagePullBackOff"):
                    msg = f'Back-off pulling image "{container["image"]}"'
                    self._patch("pods", ns, name, {"status": {"containerStatuses": [
                        {**base, "ready": False, "state": {"waiting": {"reason": reason, "message": msg}}}]}})
                    await asyncio.sleep(0.2)
                await self._gone[key].wait()
                return False
            if fault and fault.startswith("slow_start:"):
                await asyncio.sleep(float(fault.split(":", 1)[1]))
            if self.instant:
                self._terminated(ns, name, base, now_iso(), 0, None, "", [_instant_message(container) + "\n"])
                return True
            return await self._run_process(ns, pod, container, base, fault)
        finally:
            self.active -= 1
            self._gone.pop(key, None)

    async def _run_process(self, ns: str, pod: dict[str, Any], container: dict[str, Any], base: dict[str, Any],
                           fault: str | None) -> bool:
        name = pod["metadata"]["name"]
        term_log = str(Path(self._tmp.name) / f"{name}.termination-log")
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        killed = fault in ("oom", "evict", "node_lost")
        if killed:  # stopped before exec: the kill below cannot come after the agent's end
            argv = ["/bin/sh", "-c", 'kill -STOP $$; exec "$@"', "sh", *argv]
        proc = await asyncio.create_subprocess_exec(*argv, env=self._env(ns, container, term_log), cwd=self.workdir,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
        self._procs[(ns, name)] = proc
        self.pods_started += 1
        started = now_iso()
        self._patch("pods", ns, name, {"status": {
            "phase": "Running", "podIP": "10.244.0.10", "hostIP": "10.0.0.1", "startTime": started,
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{**base, "ready": True, "started": True,
                                   "state": {"running": {"startedAt": started}}}]}})
        logs = self.store.logs.setdefault((ns, name), [])
        reader = asyncio.ensure_future(self._read(proc, logs))
        if killed:
            await asyncio.sleep(self.fault_delay_s)
            _kill_if_running(proc)
        try:
            code = await proc.wait()
        except asyncio.CancelledError:  # the Job's deadline
            proc.kill()
            await proc.wait()
            raise
        finally:
            await asyncio.gather(reader, return_exceptions=True)
            self._procs.pop((ns, name), None)
        fault = self._forced.pop((ns, name), fault)
        if fault == "oom_at_exit":  # killed after its work: what the kubelet sees is an OOM kill
            code, fault = -signal.SIGKILL, "oom"
        self._terminated(ns, name, base, started, code, fault, term_log, logs)
        return code == 0 and fault is None

    async def _read(self, proc: asyncio.subprocess.Process, logs: list[str]) -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            logs.append(line.decode(errors="replace"))

    def _terminated(self, ns: str, name: str, base: dict[str, Any], started: str, code: int, fault: str | None,
                    term_log: str, logs: list[str]) -> None:
        message = Path(term_log).read_text()[:4096] if term_log and os.path.exists(term_log) else ""
        if self.instant:
            message = logs[-1]
        if code != 0 and not message:  # terminationMessagePolicy: FallbackToLogsOnError
            message = "".join(logs[-80:])[-2048:]
        exit_code = 128 + (-code) if code < 0 else code
        reason = {"oom": "OOMKilled", "node_lost": "ContainerStatusUnknown"}.get(fault or "",
                                                                                 "Completed" if code == 0 else "Error")
        term = {"exitCode": exit_code, "reason": reason, "message": message, "startedAt": started,
                "finishedAt": now_iso()}
        status: dict[str, Any] = {"phase": "Succeeded" if code == 0 and not fault else "Failed",
                                  "containerStatuses": [{**base, "ready": False, "state": {"terminated": term}}]}
        if fault == "evict":
            status.update(reason="Evicted", message="The node was low on resource: memory. ")
        if fault == "node_lost":
            status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
                                     "message": "Taint manager: deleting due to NoExecute taint"}]
        self._patch("pods", ns, name, {"status": status})
        if fault == "node_lost" and ("pods", ns, name) in self.store.objects:
            self.store.delete("pods", ns, name)


def _instant_message(container: dict[str, Any]) -> str:
    """What an instant pod reports: a succeeded outcome for its rollout, or for each of its batch's."""
    batch = next((e.get("value") for e in container.get("env") or [] if e["name"] == ENV_JOBS), None)
    if batch is None:
        return '{"status":"succeeded","reward":1.0}'
    ok = RolloutOutcome(status="succeeded", reward=1.0)
    return batch_message({job["rollout_id"]: ok for job in json.loads(batch)}, [])


def _kill_if_running(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()


def main() -> None:
    import argparse
    import threading

    ap = argparse.ArgumentParser(description="the emulated Kubernetes API server with its test kubelet")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--instant", action="store_true", help="run no containers: every pod succeeds at once")
    args = ap.parse_args()
    with K8sAPIServer(port=args.port) as api, Kubelet(api, instant=args.instant):
        print(api.url, flush=True)
        threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
