"""A Ray driver in its own process for test_controller_ray_cluster.py: joins the cluster at argv[1],
runs the async tool agent, prints the results as JSON. Its own process, so the Ray state of other
tests in the session (a local runtime's auth mode) cannot leak in.

Two runs on the same actors: t0 and t1 under a timeout they never reach, then t2, which sleeps four
times past the short timeout argv[4] (2 s on a quiet machine, scaled by the test with the measured
slowness), under that one. One short timeout for all three cut the ~0.4 s rollouts short on a loaded
CI machine."""

from __future__ import annotations

import json
import os
import sys

from lightning_middleware import TraceStore
from lightning_middleware.controller import RayBackend, RolloutController
from tests.controller import controller_agents as A


def main() -> None:
    address, store_url, base_url = sys.argv[1:4]
    timeout = float(sys.argv[4])
    import ray

    store = TraceStore(store_url)
    tasks = [{"task_id": f"t{i}", "question": f"q {i}", "base_url": base_url, "store": store_url,
              "sleep": 4 * timeout if i == 2 else 0.05} for i in range(3)]
    with RolloutController(A.async_tool_agent, store=store, backend=RayBackend(address, num_workers=2),
                           concurrency=4, timeout_s=A.UNREACHED_TIMEOUT_S) as c:
        results = c.run(tasks[:2], n=2)
        c.timeout_s = timeout
        results += c.run(tasks[2:], n=2)
        nodes = [n["Alive"] for n in ray.nodes()]
        pids = c.backend.worker_pids()  # type: ignore[attr-defined]
    rows = [[r.task_id, r.status, r.reward, r.rollout_id, round(r.duration_s, 2), r.error] for r in results]
    print(json.dumps({"results": rows, "nodes": nodes, "pids": pids, "driver": os.getpid()}))


if __name__ == "__main__":
    main()
