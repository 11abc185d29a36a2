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


def test_the_attack_list_against_pods_that_reach_only_the_gateway(llm_server) -> None:
    """The attack list of docs/reliability.md against sandboxed pods that reach only the gateway,
    enforced by the cluster (NetworkPolicy, read-only root, memory limit) and the gateway (rollout
    tokens). Needs LIGHTNING_TEST_K8S_GATEWAY_HOST: this machine's address as the pods reach it
    (kind: the docker network's gateway, e.g. 172.18.0.1), and a CNI that enforces NetworkPolicy.
    A connection the NetworkPolicy drops times out rather than being refused: it ends `sandbox_network`
    or `sandbox_limit` (the deadline) by how the agent waits; either way blocked and not retried."""
    import socket
    from urllib.parse import urlsplit

    from lightning_middleware import RewardConfig
    from lightning_middleware.controller import Sandbox
    from lightning_middleware.gateway import Gateway
    from lightning_middleware.records import SANDBOX_BREACH

    store, ns, pod_store = _cluster()
    host = _env("LIGHTNING_TEST_K8S_GATEWAY_HOST")
    token = "real-cluster-gateway-token"
    with socket.socket() as free:
        free.bind(("0.0.0.0", 0))
        port = free.getsockname()[1]
    db = urlsplit(pod_store.replace("+psycopg", ""))
    rewards = RewardConfig.from_dict({"rules": {"succeeded": 1.0}, "agent_reward": False})
    sandbox = Sandbox(egress_to=({"ipBlock": {"cidr": f"{host}/32"}, "ports": [{"port": port}]},),
                      read_only_root_fs=True, memory_bytes=512 * 2**20)
    pod = PodTemplate(image=_env("LIGHTNING_TEST_K8S_IMAGE"), namespace=ns, image_pull_policy="IfNotPresent",
                      startup_grace_s=120, sandbox=sandbox, gateway_url=f"http://{host}:{port}")
    network = {"sandbox_network", "sandbox_limit"}
    attacks = {
        "read_store": ({"path": "/var/lib/postgresql/data/PG_VERSION"}, {"sandbox_fs"}),
        "read_secret": ({"var": "LIGHTNING_STORE_URL"}, {None}),  # KeyError: the pod has none
        "connect_store": ({"attack": "connect_host", "host": db.hostname, "port": db.port or 5432}, network),
        "connect_api_server": ({"attack": "connect_host", "host": "kubernetes.default.svc", "port": 443}, network),
        "gateway_admin": ({}, {"sandbox_network"}),
        "other_rollout": ({"other": "someone-else"}, {"sandbox_network"}),
        "write_usr": ({"attack": "write_outside", "path": "/usr/lib/pwned"}, {"sandbox_fs"}),
        "write_root": ({"attack": "write_outside", "path": "/pwned"}, {"sandbox_fs"}),
        "allocate": ({}, {"sandbox_limit"}),  # the memory limit: OOM-killed
        "burn_cpu": ({}, {"sandbox_limit"}),  # no CPU-time limit in a pod: the deadline ends it
        "overrun": ({}, {"sandbox_limit"}),
        # Not here: fork_bomb (max_procs is the kubelet's podPidsLimit, a node setting this test cannot
        # assume), read_checkpoint and read_other_workdir (a pod sees only its image and volumes).
        "self_reward": ({}, {"sandbox_reward"}),
    }
    with Gateway([llm_server.base_url], store, rewards=rewards, token=token, host="0.0.0.0", port=port,
                 health_interval_s=0) as gw:
        backend = KubernetesBackend(pod, gateway=f"http://127.0.0.1:{port}", gateway_token=token,
                                    network_policy=True)
        with RolloutController("tests.controller.sandbox_agents:caller", store=store, backend=backend,
                               timeout_s=60) as c:
            (good,) = c.run([{"task_id": "ask", "prompt": "hi"}])
        with RolloutController("tests.controller.sandbox_agents:attacker", store=store, backend=backend,
                               concurrency=4, timeout_s=20, retry=RetryPolicy(max_attempts=2)) as c:
            results = {r.task_id: r for r in c.run([{"attack": n, **extra, "task_id": n}
                                                     for n, (extra, _) in attacks.items()])}
        assert not gw.gate.paused
    assert (good.status, good.reward) == ("succeeded", 1.0), good.error
    assert store.calls(good.rollout_id)[0].completion_token_ids
    events = {e.data["rollout_id"]: e.data["class"] for e in store.events(kind=SANDBOX_BREACH)}
    for name, (_, classes) in attacks.items():
        r = results[name]
        kind = events.get(r.rollout_id) or (r.error or "").split(":")[0]
        kind = kind if kind.startswith("sandbox_") else None
        assert r.status != "succeeded" and r.attempts == 1 and kind in classes, (name, r.status, r.error)
