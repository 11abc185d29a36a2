"""Fixtures of the controller tests: `cluster`, the emulated Kubernetes API server with its test kubelet."""

from tests.controller.k8s_fixtures import cluster

__all__ = ["cluster"]
