"""`lightning-mw rollouts run|eval|metrics|reap|worker`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from lightning_middleware.asgi.auth import TOKEN_ENV
from lightning_middleware.controller.backends import KubernetesBackend, PodTemplate
from lightning_middleware.controller.backends.k8s_template import load_template
from lightning_middleware.controller.backends.sandboxed import SandboxedBackend
from lightning_middleware.controller.evaluation import Evaluator, format_history, format_metrics
from lightning_middleware.controller.jobs import RetryPolicy
from lightning_middleware.controller.rollout_controller import RolloutController, reap_stale
from lightning_middleware.controller.sandbox import Sandbox, load_sandbox
from lightning_middleware.controller.worker import run_worker
from lightning_middleware.errors import UsageError
from lightning_middleware.store import open_store


def add_cli(sub: Any) -> None:
    p = sub.add_parser("rollouts", help="run an agent over a task set, evaluate, reap stale rollouts")
    cmds = p.add_subparsers(dest="rollouts_command", metavar="ACTION")

    def common(q: Any) -> None:
        q.add_argument("--agent", required=True, help="the agent function, as package.module:function")
        q.add_argument("--tasks", required=True, help="JSONL file, one task (a JSON object) per line")
        q.add_argument("--store", default=None,
                       help="store URL (default: env LIGHTNING_STORE_URL or ./lightning_traces.db)")
        q.add_argument("--backend", default="auto", choices=["auto", "asyncio", "thread", "process", "ray", "k8s",
                                                                  "sandbox"])
        q.add_argument("--concurrency", type=int, default=8)
        q.add_argument("--timeout", type=float, default=None,
                       help="per-rollout timeout, seconds (a task's own timeout_s wins)")
        q.add_argument("--retries", type=int, default=2, help="extra attempts after an infrastructure error")
        q.add_argument("--workers", type=int, default=None, help="worker processes / Ray actors")
        q.add_argument("--ray-address", default=None,
                       help="existing Ray cluster: auto, ray://head:10001 or head:6379 (default: a local runtime)")
        q.add_argument("--k8s-template", default=None, help="pod template for --backend k8s (TOML or JSON)")
        q.add_argument("--k8s-image", default=None, help="the rollout image (overrides the template's)")
        q.add_argument("--k8s-namespace", default=None, help="namespace of the rollout Jobs")
        q.add_argument("--k8s-api-url", default=None, help="API server URL without auth (default: kubeconfig)")
        q.add_argument("--k8s-rollouts-per-job", type=int, default=1, metavar="N",
                       help="run up to N rollouts one after another in each Job's pod (default 1)")
        q.add_argument("--k8s-pod-concurrency", type=int, default=1, metavar="K",
                       help="with --k8s-rollouts-per-job: K of a pod's rollouts at once (default 1)")
        q.add_argument("--gateway", default=None, metavar="URL",
                       help="for --backend sandbox, or k8s with pods that reach only the gateway: the gateway "
                            "the rollouts call (token: $LIGHTNING_GATEWAY_TOKEN)")
        q.add_argument("--sandbox", default=None, metavar="FILE",
                       help="for --backend sandbox: the Sandbox settings, a TOML [sandbox] table or JSON "
                            "(default: the built-in limits)")
        q.add_argument("--rewards", default=None, metavar="FILE",
                       help="a reward configuration (TOML/JSON) each rollout is scored under (docs/rewards.md)")

    r = cmds.add_parser("run", help="n samples per task (mode train or val)")
    common(r)
    r.add_argument("-n", type=int, default=1, help="samples per task (the GRPO group size)")
    r.add_argument("--mode", default="train", choices=["train", "val"])
    r.set_defaults(func=_cli_run)

    e = cmds.add_parser("eval", help="mode=val rollouts on a held-out task set; metrics stored and shown")
    common(e)
    e.add_argument("-n", type=int, default=1)
    e.add_argument("--step", type=int, default=None, help="training step this evaluation belongs to")
    e.add_argument("--name", default="val")
    e.add_argument("--success-threshold", type=float, default=1.0)
    e.set_defaults(func=_cli_eval)

    m = cmds.add_parser("metrics", help="show stored evaluation results")
    m.add_argument("--store", default=None)
    m.add_argument("--name", default=None)
    m.set_defaults(func=_cli_metrics)

    k = cmds.add_parser("reap", help="end running rollouts whose lease heartbeat is older than --older-than")
    k.add_argument("--store", default=None)
    k.add_argument("--older-than", type=float, default=300.0, help="seconds")
    k.add_argument("--include-unleased", action="store_true",
                   help="also end running rollouts without a lease created before the cutoff")
    k.set_defaults(func=_cli_reap)

    w = cmds.add_parser("worker", help="run the one rollout a pod's environment names (the k8s Job entrypoint)")
    w.set_defaults(func=lambda _a: run_worker())
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])


def backend_from(args: Any) -> str | KubernetesBackend | SandboxedBackend:
    """The backend `lightning-mw rollouts run` arguments name: a built-in's name, or a configured one."""
    if args.backend == "sandbox":
        return _sandboxed_from(args)
    if args.backend != "k8s":
        return str(args.backend)
    overrides = {"image": args.k8s_image, "namespace": args.k8s_namespace}
    if args.k8s_template:
        template = load_template(args.k8s_template, **overrides)
    elif args.k8s_image:
        template = PodTemplate(image=args.k8s_image, namespace=args.k8s_namespace or "default")
    else:
        raise UsageError("--backend k8s needs --k8s-template FILE or --k8s-image IMAGE")
    if args.k8s_rollouts_per_job < 1 or args.k8s_pod_concurrency < 1:
        raise UsageError("--k8s-rollouts-per-job and --k8s-pod-concurrency must be >= 1, not "
                         f"{args.k8s_rollouts_per_job}, {args.k8s_pod_concurrency}")
    if args.gateway and args.rewards:
        raise UsageError("--backend k8s with --gateway is scored by the gateway's reward configuration "
                         "(lightning-mw gateway --rewards FILE), not --rewards")
    return KubernetesBackend(template, api_url=args.k8s_api_url, max_jobs=args.workers,
                             rollouts_per_job=args.k8s_rollouts_per_job, pod_concurrency=args.k8s_pod_concurrency,
                             gateway=args.gateway or None)


def _sandboxed_from(args: Any) -> SandboxedBackend:
    if not args.gateway:
        raise UsageError("--backend sandbox needs --gateway URL: sandboxed rollouts reach the LLM only "
                         "through the gateway")
    if args.rewards:
        raise UsageError("--backend sandbox is scored by the gateway's reward configuration "
                         "(lightning-mw gateway --rewards FILE), not --rewards")
    sandbox = load_sandbox(args.sandbox) if args.sandbox else Sandbox()
    return SandboxedBackend(args.gateway, token=os.environ.get(TOKEN_ENV) or None, sandbox=sandbox,
                            workers=args.workers)


def _controller_from(args: Any) -> RolloutController:
    sys.path.insert(0, os.getcwd())
    return RolloutController(args.agent, store=args.store, backend=backend_from(args), concurrency=args.concurrency,
                             timeout_s=args.timeout, retry=RetryPolicy(max_attempts=1 + max(0, args.retries)),
                             workers=args.workers, ray_address=args.ray_address, rewards=args.rewards)


def _sigterm_as_ctrl_c() -> None:
    # So that SIGTERM (kubectl delete, a CI timeout) ends a run as Ctrl-C does: the run is cancelled
    # and each rollout it started records its end, then the `with` block's close() stops worker
    # processes and Ray actors and deletes the run's k8s Jobs.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    handler = signal.getsignal(signal.SIGINT)  # the controller's run installs its own while it runs
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored (a background job of a non-interactive shell): SIGTERM still stops the run
        raise KeyboardInterrupt


def _cli_run(args: Any) -> int:
    _sigterm_as_ctrl_c()
    t0 = time.monotonic()
    with _controller_from(args) as c:
        results = c.run(args.tasks, n=args.n, mode=args.mode)
    wall = time.monotonic() - t0
    by: dict[str, int] = {}
    for res in results:
        by[res.status] = by.get(res.status, 0) + 1
    rewards = [res.reward for res in results if res.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    print(f"{len(results)} rollouts in {wall:.1f}s ({len(results) / max(wall, 1e-9):.1f}/s): "
          + ", ".join(f"{k}={v}" for k, v in sorted(by.items()))
          + f"; mean reward {mean:.3f}; retried {c.stats.retried}; max in flight {c.stats.max_in_flight}")
    return 0 if by.get("succeeded", 0) == len(results) else 1


def _cli_eval(args: Any) -> int:
    _sigterm_as_ctrl_c()
    with _controller_from(args) as c:
        ev = Evaluator(c, args.tasks, n=args.n, name=args.name, success_threshold=args.success_threshold)
        result = ev.evaluate(step=args.step)
    print(format_metrics(result.metrics))
    return 0


def _cli_metrics(args: Any) -> int:
    store = open_store(args.store)
    try:
        print(format_history(store.eval_results(args.name)))
    finally:
        store.close()
    return 0


def _cli_reap(args: Any) -> int:
    store = open_store(args.store)
    try:
        ended = reap_stale(store, args.older_than, include_unleased=args.include_unleased)
    finally:
        store.close()
    print(f"ended {len(ended)} stale rollouts" + (": " + ", ".join(ended) if ended else ""))
    return 0
