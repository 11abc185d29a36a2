"""Every object `lightning-mw k8s manifests` renders, and every rollout Job the backend creates, is valid
against the Kubernetes OpenAPI schemas (kubernetes-validate bundles them: nothing is downloaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_middleware.controller import PodTemplate, Sandbox
from lightning_middleware.controller.backends.k8s_template import job_manifest, network_policy
from lightning_middleware.controller.jobs import RolloutJob
from lightning_middleware.deploy import load_config, render, to_yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")
K8S_VERSION = "1.31.0"
ROOT = Path(__file__).resolve().parents[2]

SYSTEM = """
image = "ghcr.io/example/lightning-middleware:0.1"
namespace = "rl"
storage_class = "fast-ssd"

[vllm]
model = "qwen2.5-0.5b"
gpus = 2
max_lora_rank = 16
extra_args = ["--max-num-seqs", "64"]

[gateway]
replicas = 2

[trainer]
gpus = 1
checkpoint_storage = "50Gi"
args = ["--algo", "grpo"]
"""


def _valid(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any schema error or unknown field


def _by_kind(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_the_system_manifests_are_valid_and_wired_together(tmp_path: Path) -> None:
    path = tmp_path / "system.toml"
    path.write_text(SYSTEM)
    objects = render(load_config(str(path)))
    for obj in objects:
        _valid(obj)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "Secret", "Service", "StatefulSet", "Deployment", "Service", "Secret",
                            "Deployment", "Service", "PersistentVolumeClaim", "Deployment", "ServiceAccount",
                            "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy"])
    by = _by_kind(objects)
    vllm = by[("Deployment", "lightning-vllm")]["spec"]["template"]["spec"]["containers"][0]
    assert vllm["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert vllm["args"][vllm["args"].index("--max-lora-rank") + 1] == "16" and "--max-num-seqs 64" in vllm["args"]
    gw = by[("Deployment", "lightning-gateway")]
    assert gw["spec"]["replicas"] == 2
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gw["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LIGHTNING_GATEWAY_TOKEN"]["name"] == "lightning-gateway-token"
    assert "--upstream" in gw["spec"]["template"]["spec"]["containers"][0]["args"]
    trainer = by[("Deployment", "lightning-trainer")]["spec"]
    assert trainer["strategy"] == {"type": "Recreate"} and trainer["replicas"] == 1
    args = trainer["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--lora-rank") + 1] == "16" and args[args.index("--store") + 1] == "$(LIGHTNING_STORE_URL)"
    pvc = by[("PersistentVolumeClaim", "lightning-trainer-checkpoints")]["spec"]
    assert pvc["resources"]["requests"]["storage"] == "50Gi" and pvc["storageClassName"] == "fast-ssd"
    store_url = by[("Secret", "lightning-store")]["stringData"]["url"]
    assert store_url.startswith("postgresql+psycopg://lightning:") and "@lightning-postgres:5432/" in store_url
    role = by[("Role", "lightning-rollout-jobs")]
    assert {"create", "watch", "deletecollection"} <= set(role["rules"][0]["verbs"])
    assert by[("RoleBinding", "lightning-rollout-jobs")]["subjects"][0]["name"] == "lightning-rollout-controller"
    assert by[("ServiceAccount", "lightning-rollout")]["automountServiceAccountToken"] is False
    egress = by[("NetworkPolicy", "lightning-rollout-sandbox")]["spec"]["egress"]
    peers = [p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in egress[1]["to"]]
    assert peers == ["lightning-gateway", "lightning-postgres"] and egress[0]["ports"][0]["port"] == 53
    assert all(o["metadata"].get("namespace", "rl") == "rl" for o in objects)
    assert len(list(yaml.safe_load_all(to_yaml(objects)))) == len(objects)


def test_an_external_store_needs_its_address_for_the_network_policy(tmp_path: Path) -> None:
    path = tmp_path / "system.toml"
    path.write_text('image = "x"\n[store]\nurl = "postgresql+psycopg://u:p@db.example:5432/t"\n')
    proc = subprocess.run([sys.executable, "-m", "lightning_middleware.deploy.cli", "manifests", "--config",
                           str(path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "egress_cidr is required" in proc.stderr and "Traceback" not in proc.stderr
    path.write_text('image = "x"\n[store]\nurl = "postgresql+psycopg://u:p@db.example:5432/t"\n'
                    'egress_cidr = "10.1.2.0/24"\n')
    out = tmp_path / "all.yaml"
    proc = subprocess.run([sys.executable, "-m", "lightning_middleware.deploy.cli", "manifests", "--config",
                           str(path), "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    objects = list(yaml.safe_load_all(out.read_text()))
    for obj in objects:
        _valid(obj)
    by = _by_kind(objects)
    assert ("StatefulSet", "lightning-postgres") not in by
    assert by[("NetworkPolicy", "lightning-rollout-sandbox")]["spec"]["egress"][1]["to"][1] == \
        {"ipBlock": {"cidr": "10.1.2.0/24"}}
    path.write_text('image = "x"\n[vllm]\ngpu = 1\n')
    proc = subprocess.run([sys.executable, "-m", "lightning_middleware.deploy.cli", "manifests", "--config",
                           str(path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "unknown keys ['gpu']" in proc.stderr


def test_rollout_jobs_are_valid_with_and_without_the_sandbox() -> None:
    job = RolloutJob(rollout_id="f" * 32, task_id="task/with spaces", task={"q": 1}, timeout_s=100.5,
                     store_url="sqlite:///x.db")
    plain = PodTemplate(image="img:1", namespace="rl", node_selector={"pool": "cpu"},
                        service_account="lightning-rollout", resources={"limits": {"memory": "1Gi"}},
                        env={"OPENAI_BASE_URL": "http://lightning-gateway:8090/v1"})
    boxed = PodTemplate(image="img:1", namespace="rl", store_url_secret=("lightning-store", "url"),
                        sandbox=Sandbox(egress_to=({"podSelector": {"matchLabels": {"a": "b"}}},),
                                        workspace_volume={"persistentVolumeClaim": {"claimName": "repo"}},
                                        run_as_non_root=True))
    for tmpl in (plain, boxed):
        _valid(job_manifest(tmpl, job, run_id="r1", agent_ref="pkg.mod:fn"))
    _valid(network_policy("p", "rl", ()))
    broken = job_manifest(plain, job, run_id="r1", agent_ref="pkg.mod:fn")
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = ["Always"]
    broken["spec"]["backofLimit"] = 0
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        _valid(broken)
    j = job_manifest(plain, job, run_id="r1", agent_ref="pkg.mod:fn")
    assert j["spec"]["activeDeadlineSeconds"] == 161 and j["metadata"]["annotations"] == \
        {"lightning-middleware/task-id": "task/with spaces"}  # not a label value: an annotation
    pod = j["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["serviceAccountName"] == "lightning-rollout"
    assert "automountServiceAccountToken" not in pod and "securityContext" not in pod["containers"][0]
    b = job_manifest(boxed, job, run_id="r1", agent_ref="pkg.mod:fn")["spec"]["template"]["spec"]
    c = b["containers"][0]
    assert b["automountServiceAccountToken"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/workspace/.git"]["readOnly"] is True and "/tmp" in mounts and "/workspace" in mounts
    env = {e["name"]: e for e in c["env"]}
    assert env["LIGHTNING_STORE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "lightning-store", "key": "url"}
    assert env["GIT_DIR"]["value"].startswith("/dev/null")
    assert env["LIGHTNING_SANDBOX"]["value"] == "1" and env["LIGHTNING_SANDBOX_WORKSPACE"]["value"] == "/workspace"
    assert c["resources"] == {"limits": {"memory": str(2 * 2**30)}}  # the local sandbox's memory_bytes
    own = PodTemplate(image="img:1", resources={"limits": {"memory": "1Gi"}, "requests": {"cpu": "1"}},
                      sandbox=Sandbox(memory_bytes=4 << 30))
    r = job_manifest(own, job, run_id="r1", agent_ref="pkg.mod:fn")["spec"]["template"]["spec"]["containers"][0]
    assert r["resources"] == {"limits": {"memory": "1Gi"}, "requests": {"cpu": "1"}}  # the template's own wins
    assert own.resources == {"limits": {"memory": "1Gi"}, "requests": {"cpu": "1"}}  # and is not changed
    unlimited = PodTemplate(image="img:1", sandbox=Sandbox(memory_bytes=None))
    u = job_manifest(unlimited, job, run_id="r1", agent_ref="pkg.mod:fn")["spec"]["template"]["spec"]
    assert "resources" not in u["containers"][0]
    for tmpl in (own, unlimited):
        _valid(job_manifest(tmpl, job, run_id="r1", agent_ref="pkg.mod:fn"))
    with pytest.raises(ValueError, match="unknown sandbox keys"):
        PodTemplate.from_dict({"image": "x", "sandbox": {"max_proc": 3}})
    with pytest.raises(ValueError, match="max_procs must be a positive whole number"):
        Sandbox(max_procs=0)
    with pytest.raises(ValueError, match="unknown pod template keys"):
        PodTemplate.from_dict({"image": "x", "imagee": "y"})


def test_the_light_core_does_not_import_the_kubernetes_client() -> None:
    code = ("import sys, lightning_middleware.controller, lightning_middleware.deploy,"
            " lightning_middleware.controller.cli;"
            "print(sorted(m for m in ('kubernetes', 'kubernetes_validate', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_a_reward_configuration_travels_to_the_pod_by_path_only() -> None:
    from lightning_middleware.rewards import RewardConfig

    tmpl = PodTemplate(image="img:1")
    by_path = RolloutJob(rollout_id="a" * 32, task_id="t", task={}, rewards="/etc/lightning/rewards.toml")
    env = {e["name"]: e.get("value") for e in
           job_manifest(tmpl, by_path, run_id="r", agent_ref="m:f")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert '"rewards":"/etc/lightning/rewards.toml"' in env["LIGHTNING_ROLLOUT_JOB"]
    with pytest.raises(ValueError, match="as a file path"):
        job_manifest(tmpl, RolloutJob(rollout_id="b" * 32, task_id="t", task={},
                                rewards=RewardConfig.from_dict({"reward_type": "rule", "human": {}})),
                     run_id="r", agent_ref="m:f")
