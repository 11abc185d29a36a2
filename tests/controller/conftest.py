"""Fixtures of the controller tests: `cluster`, the emulated Kubernetes API server with its test kubelet,
and `slowness`, the factor its tests' timeouts are scaled by on a slow or loaded machine."""

from tests.controller.k8s_fixtures import cluster, slowness

__all__ = ["cluster", "slowness"]
