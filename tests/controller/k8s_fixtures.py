"""Shared pieces of the Kubernetes backend tests: the emulated API server with its test kubelet, and
a pod template whose container command runs this checkout's worker entrypoint as a local process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_middleware.controller import PodTemplate
from lightning_middleware.testing.k8s_api import K8sAPIServer
from lightning_middleware.testing.kubelet import Kubelet, job_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = (sys.executable, "-m", "lightning_middleware.controller.worker")
# Eight cold imports of the worker at once (a test's pods starting together): 4.2 s on a 2-core
# AVX2 EPYC with the test suite running beside them, the load the tests' timeouts were written for.
QUIET_STARTS_S = 4.2


def template(**kw: Any) -> PodTemplate:
    base: dict[str, Any] = {"image": "lightning/rollout:test", "namespace": "rollouts", "command": WORKER,
                            "env": {"PYTHONPATH": str(ROOT)}, "startup_grace_s": 30.0,
                            "resources": {"limits": {"memory": "512Mi", "cpu": "1"}}}
    return PodTemplate(**{**base, **kw})


def task_fault(job: dict[str, Any]) -> str | None:
    """The fault a test task asks for (`task["fault"]`), on its first attempt only (the retry runs clean);
    for a batch Job, the first such fault among its rollouts."""
    env = job_env(job)
    specs = json.loads(env["LIGHTNING_ROLLOUT_JOBS"]) if "LIGHTNING_ROLLOUT_JOBS" in env \
        else [json.loads(env["LIGHTNING_ROLLOUT_JOB"])]
    return next((s["task"]["fault"] for s in specs if s["attempt"] == 1 and s["task"].get("fault")), None)


@pytest.fixture(scope="module")
def slowness() -> float:
    """How many times slower than QUIET_STARTS_S this machine starts the tests' pods now (at least 1, in
    steps of 0.5): the timeouts and deadlines a test waits on are multiplied by it, so a loaded or slow
    machine gets the same margins instead of a flake. Measured once per module (a few seconds)."""
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", "import lightning_middleware.controller.worker"], cwd=ROOT)
             for _ in range(8)]
    for p in procs:
        p.wait()
    return max(1.0, round(2 * (time.monotonic() - t0) / QUIET_STARTS_S) / 2)


@pytest.fixture
def cluster() -> Iterator[tuple[K8sAPIServer, Kubelet]]:
    with K8sAPIServer() as api, Kubelet(api, faults=task_fault, workdir=str(ROOT)) as kubelet:
        yield api, kubelet
