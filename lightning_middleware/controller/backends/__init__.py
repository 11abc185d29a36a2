"""Where rollouts run: "asyncio" (async agents), "thread" (sync agents), "process" (a pool of
worker processes), "ray" (actors on a Ray cluster), all behind the `Backend` protocol."""

from __future__ import annotations

import inspect

from lightning_middleware.controller.backends.base import Backend
from lightning_middleware.controller.backends.local import AsyncioBackend, ThreadBackend
from lightning_middleware.controller.backends.process import ProcessBackend
from lightning_middleware.controller.backends.ray_backend import RayBackend
from lightning_middleware.controller.execution import AgentFn

__all__ = ["AsyncioBackend", "Backend", "ProcessBackend", "RayBackend", "ThreadBackend", "make_backend"]


def make_backend(backend: str | Backend, agent: AgentFn | str, *, concurrency: int,
                 workers: int | None = None, ray_address: str | None = None) -> Backend:
    if not isinstance(backend, str):
        return backend
    if backend == "auto":
        backend = "asyncio" if (callable(agent) and inspect.iscoroutinefunction(agent)) else "thread"
    if backend == "asyncio":
        return AsyncioBackend()
    if backend == "thread":
        return ThreadBackend(max_workers=workers or 2 * concurrency)  # room for abandoned (timed-out) threads
    if backend == "process":
        return ProcessBackend(workers=workers)
    if backend == "ray":
        return RayBackend(ray_address, num_workers=workers or 2,
                          per_worker_concurrency=max(1, -(-concurrency // (workers or 2))))
    raise ValueError(f"unknown backend {backend!r}: use auto, asyncio, thread, process or ray")
