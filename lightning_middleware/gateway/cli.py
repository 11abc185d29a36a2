"""`lightning-mw gateway`: serve the capturing proxy on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from lightning_middleware.asgi.auth import TOKEN_ENV
from lightning_middleware.asgi.error_replies import GatewayConfigError
from lightning_middleware.asgi.replies import bind_socket
from lightning_middleware.errors import UsageError
from lightning_middleware.gateway.service import KEEP_ALIVE_S, Gateway

log = logging.getLogger(__name__)


def add_cli(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run the OpenAI-compatible capturing proxy in front of vLLM")
    p.add_argument("--upstream", action="append", required=True, metavar="URL",
                   help="a vLLM OpenAI server, e.g. http://127.0.0.1:8000/v1 (repeat for replicas)")
    p.add_argument("--store", default=None,
                   help="trace store URL (default: $LIGHTNING_STORE_URL or ./lightning_traces.db)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; others need --token)")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--token", default=None, help=f"bearer token clients must send (or set ${TOKEN_ENV})")
    p.add_argument("--upstream-api-key", default=None,
                   help="key sent to the upstreams (or $LIGHTNING_UPSTREAM_API_KEY)")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="request body size limit (default 16; 413 over it)")
    p.add_argument("--max-header-kb", type=float, default=64.0,
                   help="request headers size limit, all of them together (default 64; 431 over it)")
    p.add_argument("--pause-mode", choices=("wait", "reject"), default="wait",
                   help="while paused, new calls wait (up to --pause-wait) or get 429 at once")
    p.add_argument("--pause-wait", type=float, default=30.0, help="seconds a call waits out a pause before 429")
    p.add_argument("--upstream-timeout", type=float, default=600.0, help="read timeout per upstream call (504)")
    p.add_argument("--keep-alive", type=int, default=KEEP_ALIVE_S,
                   help=f"seconds an idle client connection stays open (default {KEEP_ALIVE_S}: longer than "
                        "HTTP clients keep idle connections, so a reused one is never closed under them)")
    p.add_argument("--health-interval", type=float, default=5.0)
    p.add_argument("--retry-window", type=float, default=30.0,
                   help="an identical body resent within a rollout this soon after success is answered from it")
    p.add_argument("--policy-version", type=int, default=None, help="policy version served at start")
    p.add_argument("--policy", action="append", default=[], metavar="AGENT=MODEL",
                   help="route the calls of agent AGENT (its x-agent-name header) to the served model MODEL, "
                        "its own policy (a LoRA adapter); repeatable")
    p.add_argument("--default-policy", default=None, metavar="MODEL",
                   help="the served model for calls of every other agent (default: as the request says)")
    p.add_argument("--no-record-unattached", action="store_true", help="don't record calls outside rollouts")
    p.add_argument("--no-translate", action="store_true",
                   help="send /v1/responses and /v1/messages upstream as they are (replicas that speak those "
                        "formats; no token IDs) instead of as chat completions")
    p.add_argument("--exact-history", action="store_true",
                   help="send a rollout's earlier tool-calling turns upstream as the text the model sampled, "
                        "not re-rendered by the chat template (ChatML/hermes-style templates; docs/gateway.md)")
    p.add_argument("--rewards", default=None, metavar="FILE",
                   help="a reward configuration (TOML/JSON) each rollout is scored under as it finishes")
    p.set_defaults(func=run_cli)


def _policies(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        agent, sep, model = pair.partition("=")
        if not sep or not agent or not model:
            raise ValueError(f"--policy wants AGENT=MODEL, got {pair!r}")
        out[agent] = model
    return out


def run_cli(args: argparse.Namespace) -> int:
    import uvicorn

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.verbose:  # HTTP clients' per-request INFO logs: noise, and a cost per call
        for name in ("httpx", "httpcore", "aiohttp"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        gw = Gateway(args.upstream, args.store, host=args.host, port=args.port, token=token,
                     upstream_api_key=args.upstream_api_key or os.environ.get("LIGHTNING_UPSTREAM_API_KEY"),
                     max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                     max_header_bytes=int(args.max_header_kb * 1024), pause_mode=args.pause_mode,
                     pause_wait_s=args.pause_wait, upstream_timeout_s=args.upstream_timeout,
                     health_interval_s=args.health_interval, retry_window_s=args.retry_window,
                     keep_alive_s=args.keep_alive,
                     policy_version=args.policy_version, record_unattached=not args.no_record_unattached,
                     translate=not args.no_translate, policies=_policies(args.policy),
                     default_policy=args.default_policy, rewards=args.rewards,
                     exact_history=args.exact_history)
    except (GatewayConfigError, ValueError) as exc:  # one line, as every command's bad input
        raise UsageError(str(exc)) from None
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        raise UsageError(f"can't listen on {args.host}:{args.port} ({exc.strerror or exc})") from None
    gw.port = sock.getsockname()[1]
    log.info("gateway on %s -> %s, store %s%s", gw.base_url, ", ".join(u.url for u in gw.upstreams),
             gw.store.safe_url, " (token required)" if token else "")
    server = uvicorn.Server(uvicorn.Config(gw.app, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=10, timeout_keep_alive=gw.keep_alive_s))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass
    return 0
