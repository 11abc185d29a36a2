"""`lightning-mw k8s manifests|reap`."""

from __future__ import annotations

import sys
from typing import Any

from lightning_middleware.errors import UsageError


def add_cli(sub: Any) -> None:
    p = sub.add_parser("k8s", help="Kubernetes: render the system's manifests, reap orphaned rollout Jobs")
    cmds = p.add_subparsers(dest="k8s_command", metavar="ACTION")
    m = cmds.add_parser("manifests", help="render vLLM, gateway, trainer, store and rollout RBAC as YAML")
    m.add_argument("--config", required=True, help="system.toml (docs/kubernetes.md)")
    m.add_argument("--out", default="-", help="file to write (default: stdout)")
    m.set_defaults(func=_cli_manifests)
    r = cmds.add_parser("reap", help="delete rollout Jobs whose controller is gone (by label)")
    r.add_argument("--namespace", required=True)
    r.add_argument("--store", default=None, help="keep Jobs whose rollout still has a fresh lease in this store")
    r.add_argument("--older-than", type=float, default=300.0, help="seconds (Job age and lease age)")
    r.add_argument("--run", default=None, help="delete every Job of this run id instead")
    r.add_argument("--dry-run", action="store_true", help="list, do not delete")
    r.add_argument("--api-url", default=None, help="API server URL without auth (default: kubeconfig)")
    r.set_defaults(func=_cli_reap)
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])


def _cli_manifests(args: Any) -> int:
    from lightning_middleware.deploy.manifests import load_config, render, to_yaml

    text = to_yaml(render(load_config(args.config)))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        try:
            with open(args.out, "w") as f:
                f.write(text)
        except OSError as exc:
            raise UsageError(f"cannot write {args.out}: {exc}") from None
    return 0


def _cli_reap(args: Any) -> int:
    from lightning_middleware.controller.backends.k8s_client import api_client, reap_jobs
    from lightning_middleware.store import open_store

    store = open_store(args.store) if args.store else None
    names = reap_jobs(args.namespace, api=api_client(api_url=args.api_url), store=store,
                      older_than_s=args.older_than, run_id=args.run, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(names)} rollout Jobs" + (": " + ", ".join(names) if names else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m lightning_middleware.deploy.cli ...` = `lightning-mw k8s ...`."""
    from lightning_middleware.cli import run_command

    return run_command("k8s", add_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
