"""The rollout controller: run an agent over a task set, n samples per task, with a
concurrency limit, timeouts, infrastructure retries, pause/drain, leases and continuous mode,
on local, Ray or Kubernetes backends; held-out evaluation with early stopping.

    with RolloutController("mypkg.agent:run", store="sqlite:///traces.db", concurrency=16) as c:
        results = c.run("tasks.jsonl", n=8)
"""

from lightning_middleware.controller.backends import (
                                                      AsyncioBackend,
                                                      Backend,
                                                      KubernetesBackend,
                                                      PodTemplate,
                                                      ProcessBackend,
                                                      RayBackend,
                                                      Sandbox,
                                                      SandboxedBackend,
                                                      ThreadBackend,
                                                      make_backend,
)
from lightning_middleware.controller.evaluation import EarlyStopping, Evaluator, compute_metrics, reward_smoothness
from lightning_middleware.controller.execution import AgentFn, execute_job, resolve_agent
from lightning_middleware.controller.jobs import (
                                                      ControllerStats,
                                                      RetryPolicy,
                                                      RolloutJob,
                                                      RolloutOutcome,
                                                      RolloutResult,
                                                      WorkerLost,
)
from lightning_middleware.controller.rollout_controller import RolloutController, reap_stale, run_rollouts
from lightning_middleware.controller.tasks import load_tasks

__all__ = [
    "AgentFn",
    "AsyncioBackend",
    "Backend",
    "ControllerStats",
    "EarlyStopping",
    "Evaluator",
    "KubernetesBackend",
    "PodTemplate",
    "ProcessBackend",
    "RayBackend",
    "RetryPolicy",
    "RolloutController",
    "RolloutJob",
    "RolloutOutcome",
    "RolloutResult",
    "Sandbox",
    "SandboxedBackend",
    "ThreadBackend",
    "WorkerLost",
    "compute_metrics",
    "execute_job",
    "load_tasks",
    "make_backend",
    "reap_stale",
    "run_rollouts",
    "resolve_agent",
    "reward_smoothness",
]
