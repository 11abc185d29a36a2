"""Serving the policy: the vLLM server in its own environment, the weight publisher, and the
worker extension that runs inside vLLM (so nothing here may import what vLLM's env lacks)."""
