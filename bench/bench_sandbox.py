"""What the sandbox costs per rollout: the sandboxed backend against the plain process backend,
the same agents and tasks, in one run.

    python bench/bench_sandbox.py [--rollouts 40] [--concurrency 2] [--repeats 3]

Starts the test LLM server and a gateway (SQLite store in a temp dir) in this process. For each
agent (`empty`: nothing, so a rollout is all start-up; `run_code`: write a program and run it with
Python) it runs `--rollouts` rollouts through each backend, alternating backends `--repeats`
times so both see the same machine state, and prints the median rollout duration and the wall
time per rollout for each, and their ratio. The process backend's workers are warm after their
first rollout (a pool); the sandbox starts a fresh Python per rollout, by design.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_middleware import TraceStore  # noqa: E402
from lightning_middleware.controller import ProcessBackend, RolloutController, Sandbox, SandboxedBackend  # noqa: E402
from lightning_middleware.gateway import Gateway  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402


def _run(store: TraceStore, backend: object, agent: str, n: int, concurrency: int) -> tuple[float, float]:
    tasks = [{"task_id": f"t{i}", "n": i} for i in range(n)]
    t0 = time.perf_counter()
    with RolloutController(agent, store=store, backend=backend, concurrency=concurrency, timeout_s=120) as c:
        results = c.run(tasks)
    wall = time.perf_counter() - t0
    bad = [r.error for r in results if r.status != "succeeded"]
    if bad:
        raise SystemExit(f"{len(bad)} rollouts failed: {bad[:3]}")
    return statistics.median(r.duration_s for r in results), wall / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    tmp = tempfile.mkdtemp(prefix="bench-sandbox-")
    store = TraceStore(f"sqlite:///{tmp}/store.db")
    with LLMTestServer() as llm, Gateway([llm.base_url], store, health_interval_s=0) as gw:
        for agent in ("bench.sandbox_agents:empty", "bench.sandbox_agents:run_code"):
            rows: dict[str, list[tuple[float, float]]] = {"process": [], "sandbox": []}
            for _ in range(args.repeats):
                rows["process"].append(_run(store, ProcessBackend(workers=args.concurrency), agent,
                                            args.rollouts, args.concurrency))
                rows["sandbox"].append(_run(store, SandboxedBackend(gw.url, sandbox=Sandbox(),
                                                                    workers=args.concurrency), agent,
                                            args.rollouts, args.concurrency))
            med = {k: (statistics.median(d for d, _ in v), statistics.median(w for _, w in v)) for k, v in rows.items()}
            print(f"{agent.split(':')[1]:>9}: rollout duration p50 process {med['process'][0] * 1000:7.1f} ms, "
                  f"sandbox {med['sandbox'][0] * 1000:7.1f} ms (x{med['sandbox'][0] / med['process'][0]:.1f}); "
                  f"wall per rollout process {med['process'][1] * 1000:7.1f} ms, sandbox "
                  f"{med['sandbox'][1] * 1000:7.1f} ms (x{med['sandbox'][1] / med['process'][1]:.1f})", flush=True)
    store.close()


if __name__ == "__main__":
    main()
