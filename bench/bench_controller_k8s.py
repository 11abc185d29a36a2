"""What the Kubernetes backend costs the controller per rollout Job, against the emulated API server.

    /work/main/.venv/bin/python bench/bench_controller_k8s.py [--rollouts 256] [--concurrency 64] [--per-job 1,8]

The emulator and its kubelet run in their own process (`python -m lightning_middleware.testing.kubelet`),
so this process's CPU time is the controller's alone: the Job's JSON, the create call, the two
watches' events (the kubernetes client deserializes each into its models), the verdict.

- overhead (instant pods): the kubelet runs nothing, every pod "exits" 0 at once with a succeeded
  outcome in its termination message: wall and controller CPU per rollout, next to the asyncio
  backend's no-op row measured in the same run.
- end to end (real pods): each Job's container is a local worker process running the 2-call tool
  agent (a Python start-up per pod, as a container start would be): wall per rollout, few rollouts.

Each k8s cell runs once per `--per-job` value (`KubernetesBackend(rollouts_per_job=N)`), side by side,
with the Jobs it created.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_middleware import TraceStore  # noqa: E402
from lightning_middleware.controller import KubernetesBackend, PodTemplate, RolloutController  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402
from tests.controller import controller_agents as A  # noqa: E402


def emulator(instant: bool) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "lightning_middleware.testing.kubelet"] + (["--instant"] if instant else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def cell(agent: object, backend: object, tasks: list[dict], concurrency: int, store: TraceStore,
         warm: int = 8) -> tuple[float, float, int, int | None]:
    with RolloutController(agent, store=store, backend=backend, concurrency=concurrency) as c:  # type: ignore[arg-type]
        c.run(tasks[:warm])  # warm up: watches, connections
        jobs0 = backend.jobs_created if isinstance(backend, KubernetesBackend) else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        results = c.run(tasks)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    bad = [r for r in results if r.status != "succeeded"]
    for r in bad[:3]:
        print(f"  not succeeded: {r.status} after {r.attempts} attempts: {r.error}", flush=True)
    jobs = backend.jobs_created - jobs0 if isinstance(backend, KubernetesBackend) and jobs0 is not None else None
    return wall, cpu, len(results) - len(bad), jobs


def row(label: str, n: int, wall: float, cpu: float, ok: int, jobs: int | None) -> None:
    print(f"| {label} | {n} | {ok} | {'-' if jobs is None else jobs} | {wall / n * 1000:.2f} ms | "
          f"{cpu / n * 1000:.2f} ms | {n / wall:.1f}/s |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--real", type=int, default=16, help="rollouts with real worker processes")
    ap.add_argument("--real-concurrency", type=int, default=8, help="rollouts in flight in the real-pod cells")
    ap.add_argument("--per-job", default="1,8", help="rollouts_per_job values, comma-separated")
    ap.add_argument("--pod-concurrency", type=int, default=1,
                    help="also a real-pod cell with the largest --per-job and this many at once in a pod")
    args = ap.parse_args()
    per_job = [int(v) for v in args.per_job.split(",")]
    tmp = tempfile.mkdtemp(prefix="bench-k8s-")
    template = PodTemplate(image="bench:1", namespace="bench",
                           command=(sys.executable, "-m", "lightning_middleware.controller.worker"),
                           env={"PYTHONPATH": ROOT}, startup_grace_s=120)
    print("| cell | rollouts | ok | Jobs created | wall per rollout | controller CPU per rollout | rollouts/s |")
    print("|---|---|---|---|---|---|---|")
    store = TraceStore(f"sqlite:///{tmp}/asyncio.db")
    tasks = [{"task_id": f"t{i}"} for i in range(args.rollouts)]
    row("asyncio, no-op agent (same run, for scale)", args.rollouts,
        *cell(A.noop_agent, "asyncio", tasks, args.concurrency, store))
    store.close()
    proc, url = emulator(instant=True)
    try:
        for n in per_job:
            store = TraceStore(f"sqlite:///{tmp}/k8s-{n}.db")
            backend = KubernetesBackend(template, api_url=url, rollouts_per_job=n)
            row(f"k8s, instant pods (controller only), {n} per Job", args.rollouts,
                *cell("tests.controller.controller_agents:noop_agent", backend, tasks, args.concurrency, store))
            store.close()
    finally:
        proc.kill()
    proc, url = emulator(instant=False)
    try:
        with LLMTestServer() as server:
            cells = [(n, 1) for n in per_job] + ([(max(per_job), args.pod_concurrency)]
                                                  if args.pod_concurrency > 1 else [])
            for n, k in cells:
                url_db = f"sqlite:///{tmp}/k8s-real-{n}-{k}.db"
                store = TraceStore(url_db)
                tasks = [{"task_id": f"r{i}", "base_url": server.base_url, "store": url_db} for i in range(args.real)]
                backend = KubernetesBackend(template, api_url=url, rollouts_per_job=n, pod_concurrency=k)
                at_once = f", {k} at once" if k > 1 else ""
                row(f"k8s, real pods (2-call tool agent, a process per pod), {n} per Job{at_once}", args.real,
                    *cell("tests.controller.controller_agents:tool_agent", backend, tasks, args.real_concurrency,
                          store, warm=2))
                print(f"(llm calls in store: {store.count('llm_calls')})", flush=True)
                store.close()
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
