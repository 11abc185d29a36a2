"""The gateway: an OpenAI-compatible capturing proxy in front of vLLM replicas, with rollouts
over HTTP, per-rollout base URLs, retries answered once, pause/drain for weight swaps and
bearer-token auth; `GatewayClient` drives its rollout routes with safe retries.

    with Gateway("http://127.0.0.1:8000/v1", store="sqlite:///traces.db") as gw:
        client = OpenAI(base_url=gw.base_url, api_key="-")
"""

from lightning_middleware.asgi.auth import TOKEN_ENV
from lightning_middleware.asgi.error_replies import GatewayConfigError
from lightning_middleware.gateway.app import GatewayApp
from lightning_middleware.gateway.client import GatewayClient, GatewayClientError
from lightning_middleware.gateway.forwarding import POLICY_HEADER, UPSTREAM_HEADER
from lightning_middleware.gateway.service import REPLAY_HEADER, Gateway, build_app

__all__ = ["POLICY_HEADER", "REPLAY_HEADER", "TOKEN_ENV", "UPSTREAM_HEADER", "Gateway", "GatewayApp",
           "GatewayClient", "GatewayClientError", "GatewayConfigError", "build_app"]
