"""Rollout controller benchmark: scheduling overhead and throughput, local vs Ray, one run.

    /work/main/.venv/bin/python bench/bench_controller.py [--rollouts 256] [--concurrency 64]

- overhead: a no-op agent (returns 1.0, no LLM call); wall time per rollout over
  the whole batch = what the controller + backend + store (rollout row, reward,
  end, lease heartbeats) cost per rollout.
- throughput: a 2-call openai tool agent (wrapped client) against the local
  deterministic test server, 64 rollouts in flight; rollouts/s and LLM calls/s.

Backends: asyncio (async agent), thread (sync agent), ray (local runtime,
2 actors, async agent). Bounded: a few hundred rollouts per cell.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_middleware import TraceStore  # noqa: E402
from lightning_middleware.controller import RayBackend, RolloutController  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402
from tests.controller import controller_agents as A  # noqa: E402


def cell(agent, backend, tasks, concurrency: int, store: TraceStore) -> tuple[float, int]:
    with RolloutController(agent, store=store, backend=backend, concurrency=concurrency) as c:
        c.run(tasks[:8])  # warm up (workers, actors, connections)
        t0 = time.perf_counter()
        results = c.run(tasks)
        wall = time.perf_counter() - t0
    ok = sum(r.status == "succeeded" for r in results)
    return wall, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    import ray

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    tmp = tempfile.mkdtemp(prefix="bench-controller-")
    rows = []
    with LLMTestServer() as server:
        for label, kind in (("overhead (no-op agent)", "noop"), ("throughput (2-call tool agent)", "tool")):
            for name in ("asyncio", "thread", "ray"):
                url = f"sqlite:///{tmp}/{kind}-{name}.db"
                store = TraceStore(url)
                tasks = [{"task_id": f"t{i}", "question": f"q {i}", "base_url": server.base_url, "store": url}
                         for i in range(args.rollouts)]
                if kind == "noop":
                    agent = A.sync_noop_agent if name == "thread" else A.noop_agent
                else:
                    agent = A.tool_agent if name == "thread" else A.async_tool_agent
                backend = RayBackend(num_workers=2, per_worker_concurrency=args.concurrency) if name == "ray" else name
                wall, ok = cell(agent, backend, tasks, args.concurrency, store)
                calls = store.count("llm_calls")
                store.close()
                rows.append((label, name, args.rollouts, ok, wall))
                print(f"{label:32s} {name:8s} {args.rollouts:5d} rollouts ok={ok:<4d} {wall:6.2f}s "
                      f"{wall / args.rollouts * 1000:7.2f} ms/rollout {args.rollouts / wall:7.1f} rollouts/s "
                      f"(llm calls in store: {calls})", flush=True)
    ray.shutdown()
    print()
    print(f"| measure (concurrency {args.concurrency}, {args.rollouts} rollouts) | asyncio | thread | ray |")
    print("|---|---|---|---|")
    for label in dict.fromkeys(r[0] for r in rows):
        cells = {r[1]: r for r in rows if r[0] == label}
        ms = " | ".join(f"{cells[n][4] / cells[n][2] * 1000:.2f} ms/rollout, {cells[n][2] / cells[n][4]:.0f}/s"
                        for n in ("asyncio", "thread", "ray"))
        print(f"| {label} | {ms} |")


if __name__ == "__main__":
    main()
