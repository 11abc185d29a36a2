"""The whole system as Kubernetes objects, from one `system.toml` (docs/kubernetes.md):

- vLLM: a Deployment (GPUs, LoRA flags) and a Service;
- the gateway: a Deployment, a Service and the Secret with its bearer token;
- the trainer: a Deployment (one replica, Recreate) with a PersistentVolumeClaim for checkpoints;
- the store: a Secret with the PostgreSQL URL, external or a StatefulSet rendered here;
- the rollouts: the controller's ServiceAccount, a Role to manage Jobs in the namespace and its
  RoleBinding, the rollout pods' own ServiceAccount (no rights, no token), and their NetworkPolicy
  (egress to the gateway and the store, and DNS: nothing else).

Plain dicts; `render(config)` is a pure function (the tests validate every object against the
Kubernetes OpenAPI schemas) and `to_yaml` joins them into one multi-document file for `kubectl apply -f`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import quote

from lightning_middleware.controller.backends.k8s_template import MANAGED_BY, MANAGER, network_policy
from lightning_middleware.errors import UsageError

GPU = "nvidia.com/gpu"
PREFIX = "lightning"


@dataclass(frozen=True)
class StoreConfig:
    url: str | None = None  # an external PostgreSQL: stored in a Secret, never in a pod spec
    egress_cidr: str | None = None  # where the external store lives, for the rollout NetworkPolicy
    postgres_image: str = "postgres:16"
    storage: str = "20Gi"
    password: str | None = None  # default: generated at render time


@dataclass(frozen=True)
class VLLMConfig:
    model: str = "model"  # a folder on the models volume
    gpus: int = 1
    port: int = 8000
    max_model_len: int = 4096
    max_lora_rank: int | None = None  # LoRA: the trainer hot-loads adapters up to this rank
    max_loras: int = 4
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class GatewayConfig:
    port: int = 8090
    replicas: int = 1
    token: str | None = None  # default: generated at render time


@dataclass(frozen=True)
class TrainerConfig:
    gpus: int = 1
    checkpoint_storage: str = "100Gi"
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class SystemConfig:
    image: str  # the lightning-middleware image (the `train` extra, and vLLM for the server)
    namespace: str = PREFIX
    models_pvc: str = "lightning-models"  # an existing claim holding the model folders
    storage_class: str | None = None
    store: StoreConfig = field(default_factory=StoreConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def _section(cls: Any, data: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UsageError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return cls(**values)
    except TypeError as exc:
        raise UsageError(f"{where}: {exc}") from None


def load_config(path: str) -> SystemConfig:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"system config {path}: {exc}") from None
    parts = {name: _section(cls, dict(data.pop(name, {})), f"{path} [{name}]")
             for name, cls in (("store", StoreConfig), ("vllm", VLLMConfig), ("gateway", GatewayConfig),
                               ("trainer", TrainerConfig))}
    if "image" not in data:
        raise UsageError(f"{path}: `image` (the lightning-middleware image) is required")
    return _section(SystemConfig, {**data, **parts}, path)


# -- building blocks -----------------------------------------------------------------------
def _meta(cfg: SystemConfig, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": cfg.namespace,
            "labels": {MANAGED_BY: MANAGER, "app.kubernetes.io/name": name, "app.kubernetes.io/component": component}}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _deployment(cfg: SystemConfig, name: str, component: str, container: dict[str, Any], *, replicas: int = 1,
                volumes: list[dict[str, Any]] | None = None, recreate: bool = False) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [container]}
    if volumes:
        pod["volumes"] = volumes
    spec: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                            "template": {"metadata": {"labels": _meta(cfg, name, component)["labels"]}, "spec": pod}}
    if recreate:  # never two trainers (or two engines on one GPU) at once
        spec["strategy"] = {"type": "Recreate"}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(cfg, name, component), "spec": spec}


def _service(cfg: SystemConfig, name: str, component: str, port: int, *, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"app.kubernetes.io/name": name},
                            "ports": [{"name": "http" if not headless else "postgres", "port": port,
                                       "targetPort": port}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name, component), "spec": spec}


def _pvc(cfg: SystemConfig, name: str, size: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if cfg.storage_class:
        spec["storageClassName"] = cfg.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(cfg, name, "storage"),
            "spec": spec}


def _gpus(n: int) -> dict[str, Any]:
    return {"limits": {GPU: n}} if n else {}


STORE_SECRET, TOKEN_SECRET = f"{PREFIX}-store", f"{PREFIX}-gateway-token"
VLLM, GATEWAY, TRAINER, POSTGRES = f"{PREFIX}-vllm", f"{PREFIX}-gateway", f"{PREFIX}-trainer", f"{PREFIX}-postgres"
CONTROLLER_SA, ROLLOUT_SA = f"{PREFIX}-rollout-controller", f"{PREFIX}-rollout"


# -- the components ------------------------------------------------------------------------
def store_objects(cfg: SystemConfig) -> list[dict[str, Any]]:
    if cfg.store.url:
        return [{"apiVersion": "v1", "kind": "Secret", "metadata": _meta(cfg, STORE_SECRET, "store"),
                 "type": "Opaque", "stringData": {"url": cfg.store.url}}]
    password = cfg.store.password or secrets.token_urlsafe(24)
    url = f"postgresql+psycopg://lightning:{quote(password, safe='')}@{POSTGRES}:5432/lightning"
    store = {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(cfg, STORE_SECRET, "store"), "type": "Opaque",
             "stringData": {"url": url, "password": password}}
    container = {"name": "postgres", "image": cfg.store.postgres_image, "ports": [{"containerPort": 5432}],
                 "env": [{"name": "POSTGRES_USER", "value": "lightning"}, {"name": "POSTGRES_DB", "value": "lightning"},
                         _secret_env("POSTGRES_PASSWORD", STORE_SECRET, "password"),
                         {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"}],
                 "volumeMounts": [{"name": "data", "mountPath": "/var/lib/postgresql/data"}],
                 "readinessProbe": {"exec": {"command": ["pg_isready", "-U", "lightning"]}, "periodSeconds": 5}}
    claim = _pvc(cfg, "data", cfg.store.storage)
    claim["metadata"] = {"name": "data"}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(cfg, POSTGRES, "store"),
           "spec": {"serviceName": POSTGRES, "replicas": 1,
                    "selector": {"matchLabels": {"app.kubernetes.io/name": POSTGRES}},
                    "template": {"metadata": {"labels": _meta(cfg, POSTGRES, "store")["labels"]},
                                 "spec": {"containers": [container]}},
                    "volumeClaimTemplates": [claim]}}
    return [store, _service(cfg, POSTGRES, "store", 5432, headless=True), sts]


def vllm_objects(cfg: SystemConfig) -> list[dict[str, Any]]:
    v = cfg.vllm
    args = ["serve", f"/models/{v.model}", "--host", "0.0.0.0", "--port", str(v.port), "--device", "cuda",
            "--max-model-len", str(v.max_model_len), "--served-model-name", v.model]
    if v.max_lora_rank:
        args += ["--max-lora-rank", str(v.max_lora_rank), "--max-loras", str(v.max_loras)]
    if v.extra_args:
        args += ["--vllm-args", " ".join(v.extra_args)]
    container = {"name": "vllm", "image": cfg.image, "command": ["lightning-mw"], "args": args,
                 "ports": [{"containerPort": v.port}], "resources": _gpus(v.gpus),
                 "readinessProbe": {"httpGet": {"path": "/health", "port": v.port}, "periodSeconds": 10},
                 "volumeMounts": [{"name": "models", "mountPath": "/models"}, {"name": "shm", "mountPath": "/dev/shm"}]}
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": cfg.models_pvc}},
               {"name": "shm", "emptyDir": {"medium": "Memory"}}]
    return [_deployment(cfg, VLLM, "inference", container, volumes=volumes, recreate=True),
            _service(cfg, VLLM, "inference", v.port)]


def gateway_objects(cfg: SystemConfig) -> list[dict[str, Any]]:
    g = cfg.gateway
    token = {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(cfg, TOKEN_SECRET, "gateway"), "type": "Opaque",
             "stringData": {"token": g.token or secrets.token_urlsafe(32)}}
    container = {"name": "gateway", "image": cfg.image, "command": ["lightning-mw"],
                 "args": ["gateway", "--upstream", f"http://{VLLM}:{cfg.vllm.port}/v1", "--host", "0.0.0.0",
                          "--port", str(g.port)],
                 "env": [_secret_env("LIGHTNING_GATEWAY_TOKEN", TOKEN_SECRET, "token"),
                         _secret_env("LIGHTNING_STORE_URL", STORE_SECRET, "url")],
                 "ports": [{"containerPort": g.port}],
                 "readinessProbe": {"tcpSocket": {"port": g.port}, "periodSeconds": 5}}
    return [token, _deployment(cfg, GATEWAY, "gateway", container, replicas=g.replicas),
            _service(cfg, GATEWAY, "gateway", g.port)]


def trainer_objects(cfg: SystemConfig) -> list[dict[str, Any]]:
    t = cfg.trainer
    args = ["trainer", "--store", "$(LIGHTNING_STORE_URL)", "--model", f"/models/{cfg.vllm.model}",
            "--serve", f"http://{VLLM}:{cfg.vllm.port}", "--gateway", f"http://{GATEWAY}:{cfg.gateway.port}",
            "--checkpoints", "/checkpoints", *t.args]
    if cfg.vllm.max_lora_rank and "--lora-rank" not in t.args:
        args += ["--lora-rank", str(cfg.vllm.max_lora_rank)]
    container = {"name": "trainer", "image": cfg.image, "command": ["lightning-mw"], "args": args,
                 "env": [_secret_env("LIGHTNING_STORE_URL", STORE_SECRET, "url"),
                         _secret_env("LIGHTNING_GATEWAY_TOKEN", TOKEN_SECRET, "token")],
                 "resources": _gpus(t.gpus),
                 "volumeMounts": [{"name": "models", "mountPath": "/models"},
                                  {"name": "checkpoints", "mountPath": "/checkpoints"}]}
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": cfg.models_pvc}},
               {"name": "checkpoints", "persistentVolumeClaim": {"claimName": f"{TRAINER}-checkpoints"}}]
    return [_pvc(cfg, f"{TRAINER}-checkpoints", t.checkpoint_storage),
            _deployment(cfg, TRAINER, "trainer", container, volumes=volumes, recreate=True)]


def rollout_objects(cfg: SystemConfig) -> list[dict[str, Any]]:
    """RBAC for whoever runs the controller in the cluster (`--backend k8s`), the rollout pods' own
    ServiceAccount, and their NetworkPolicy."""
    manage = ["get", "list", "watch", "delete", "deletecollection"]
    rules = [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", *manage]},
             {"apiGroups": [""], "resources": ["pods"], "verbs": manage},
             {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
             {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "create"]}]
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cfg, CONTROLLER_SA, "rollouts")}
    pod_sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cfg, ROLLOUT_SA, "rollouts"),
              "automountServiceAccountToken": False}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(cfg, f"{PREFIX}-rollout-jobs", "rollouts"), "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(cfg, f"{PREFIX}-rollout-jobs", "rollouts"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{PREFIX}-rollout-jobs"},
               "subjects": [{"kind": "ServiceAccount", "name": CONTROLLER_SA, "namespace": cfg.namespace}]}
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": GATEWAY}}}]
    if cfg.store.url is None:
        peers.append({"podSelector": {"matchLabels": {"app.kubernetes.io/name": POSTGRES}}})
    elif cfg.store.egress_cidr:
        peers.append({"ipBlock": {"cidr": cfg.store.egress_cidr}})
    else:
        raise UsageError("[store] egress_cidr is required with an external store url: the rollout pods' "
                         "NetworkPolicy allows egress only to the gateway and the store")
    policy = network_policy(f"{PREFIX}-rollout-sandbox", cfg.namespace, tuple(peers))
    return [sa, pod_sa, role, binding, policy]


def render(cfg: SystemConfig) -> list[dict[str, Any]]:
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": cfg.namespace, "labels": {MANAGED_BY: MANAGER}}}
    return [namespace, *store_objects(cfg), *vllm_objects(cfg), *gateway_objects(cfg), *trainer_objects(cfg),
            *rollout_objects(cfg)]


def to_yaml(objects: list[dict[str, Any]]) -> str:
    import yaml

    return "".join("---\n" + yaml.safe_dump(o, sort_keys=False) for o in objects)
