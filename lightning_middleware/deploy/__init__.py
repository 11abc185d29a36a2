"""Deploying the system on Kubernetes: `render(load_config("system.toml"))` -> the objects to apply
(`lightning-mw k8s manifests`), and `lightning-mw k8s reap` for orphaned rollout Jobs."""

from lightning_middleware.deploy.manifests import SystemConfig, load_config, render, to_yaml

__all__ = ["SystemConfig", "load_config", "render", "to_yaml"]
