"""The Kubernetes backend on a real cluster (marked `k8s`): runs when KUBECONFIG is set, e.g. a kind
cluster with this checkout's image loaded (docs/kubernetes.md, "Testing on a real cluster").

Environment: KUBECONFIG; LIGHTNING_TEST_K8S_IMAGE (an image with this checkout, tests/ included,
installed with the `k8s` extra); LIGHTNING_TEST_K8S_STORE (a PostgreSQL URL this machine reaches) and
LIGHTNING_TEST_K8S_POD_STORE (the same database as the pods reach it; default: the same URL);
LIGHTNING_TEST_K8S_NAMESPACE (default "default"). The emulated tests (test_controller_k8s.py) always run.
"""

from __future__ import annotations

import os

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.controller import KubernetesBackend, PodTemplate, RetryPolicy, RolloutController

pytestmark = [pytest.mark.k8s,
              pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a cluster: set KUBECONFIG (kind)")]


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"KUBECONFIG is set: the real-cluster test also needs {name} (docs/kubernetes.md)")
    return value


def _cluster() -> tuple[TraceStore, str, str]:
    """The store, the namespace and the store's URL as the pods reach it, from the environment."""
    pytest.importorskip("kubernetes")
    store = TraceStore(_env("LIGHTNING_TEST_K8S_STORE"))
    ns = os.environ.get("LIGHTNING_TEST_K8S_NAMESPACE", "default")
    pod_store = os.environ.get("LIGHTNING_TEST_K8S_POD_STORE") or store.url.render_as_string(hide_password=False)
    return store, ns, pod_store


def test_rollouts_and_failures_on_a_real_cluster() -> None:
    store, ns, pod_store = _cluster()
    good = PodTemplate(image=_env("LIGHTNING_TEST_K8S_IMAGE"), namespace=ns, store_url=pod_store,
                       image_pull_policy="IfNotPresent", resources={"limits": {"memory": "512Mi"}},
                       startup_grace_s=120)
    with RolloutController("tests.controller.controller_agents:sync_noop_agent", store=store,
                           backend=KubernetesBackend(good), concurrency=4, timeout_s=60) as c:
        results = c.run([{"task_id": f"k{i}"} for i in range(4)])
    assert all(r.status == "succeeded" and r.reward == 1.0 for r in results), results
    assert all(store.get_rollout(r.rollout_id).status == "succeeded" for r in results)

    bad_image = PodTemplate(image="registry.invalid/lightning/nope:0", namespace=ns, store_url=pod_store,
                            startup_grace_s=120)
    with RolloutController("tests.controller.controller_agents:sync_noop_agent", store=store,
                           backend=KubernetesBackend(bad_image), timeout_s=60,
                           retry=RetryPolicy(max_attempts=1)) as c:
        (pulled,) = c.run([{"task_id": "pull"}])
    assert pulled.status == "failed" and "PodImagePullFailed" in pulled.error

    with RolloutController("tests.controller.controller_agents:exit_agent", store=store,
                           backend=KubernetesBackend(good), timeout_s=60) as c:
        (exited,) = c.run([{"task_id": "exit", "exit_code": 3}])
    assert exited.status == "failed" and "exited with code 3" in exited.error and "agent log line 29" in exited.error


def test_several_rollouts_per_job_on_a_real_cluster() -> None:
    store, ns, pod_store = _cluster()
    good = PodTemplate(image=_env("LIGHTNING_TEST_K8S_IMAGE"), namespace=ns, store_url=pod_store,
                       image_pull_policy="IfNotPresent", startup_grace_s=120)
    backend = KubernetesBackend(good, rollouts_per_job=4, batch_linger_s=1.0)
    with RolloutController("tests.controller.controller_agents:sync_noop_agent", store=store, backend=backend,
                           concurrency=8, timeout_s=60, policy_version=0) as c:
        results = c.run([{"task_id": f"b{i}"} for i in range(8)])
    assert all(r.status == "succeeded" and r.reward == 1.0 and r.attempts == 1 for r in results), results
    assert backend.jobs_created == 2  # the termination message carried every rollout's outcome
