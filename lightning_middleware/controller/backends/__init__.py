"""Where rollouts run: "asyncio" (async agents), "thread" (sync agents), "process" (a pool of
worker processes), "ray" (actors on a Ray cluster), "k8s" (a Kubernetes Job per rollout, or per
batch of rollouts), a SandboxedBackend (one bubblewrap sandbox per rollout), all behind the `Backend` protocol.
Ray and the kubernetes client are imported only when used."""

from __future__ import annotations

import inspect

from lightning_middleware.controller.backends.base import Backend
from lightning_middleware.controller.backends.k8s import KubernetesBackend
from lightning_middleware.controller.backends.k8s_template import PodTemplate
from lightning_middleware.controller.backends.local import AsyncioBackend, ThreadBackend
from lightning_middleware.controller.backends.process import ProcessBackend
from lightning_middleware.controller.backends.ray_backend import RayBackend
from lightning_middleware.controller.backends.sandboxed import SandboxedBackend
from lightning_middleware.controller.execution import AgentFn
from lightning_middleware.controller.sandbox import Sandbox

__all__ = ["AsyncioBackend", "Backend", "KubernetesBackend", "PodTemplate", "ProcessBackend", "RayBackend", "Sandbox",
           "SandboxedBackend", "ThreadBackend", "make_backend"]


def make_backend(backend: str | Backend, agent: AgentFn | str, *, concurrency: int,
                 workers: int | None = None, ray_address: str | None = None,
                 k8s_template: PodTemplate | None = None) -> Backend:
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
    if backend == "k8s":
        if k8s_template is None:
            raise ValueError("backend 'k8s' needs a pod template: k8s_template=PodTemplate(image=...)")
        return KubernetesBackend(k8s_template, max_jobs=workers)
    raise ValueError(f"unknown backend {backend!r}: use auto, asyncio, thread, process, ray or k8s")
