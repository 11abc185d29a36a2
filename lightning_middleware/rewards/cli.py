"""`lightning-mw rewards`: check a configuration, re-score stored rollouts, calibrate the reward
model against human labels, serve the labelling page.

    lightning-mw rewards check rewards.toml
    lightning-mw rewards rescore --store URL --config rewards.toml [--apply none|unconsumed|all]
    lightning-mw rewards calibrate --store URL [--config rewards.toml]
    lightning-mw rewards label --store URL [--config rewards.toml] [--port 8095] [--token T]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from lightning_middleware.errors import UsageError
from lightning_middleware.rewards.combine import APPLY, Scorer
from lightning_middleware.rewards.config import load_config
from lightning_middleware.store import open_store

log = logging.getLogger(__name__)
TOKEN_ENV = "LIGHTNING_LABEL_TOKEN"


def add_cli(sub: Any) -> None:
    p = sub.add_parser("rewards", help="reward configurations: check, re-score stored rollouts, calibrate, label")
    cmds = p.add_subparsers(dest="rewards_command", metavar="ACTION", required=True)

    c = cmds.add_parser("check", help="load a reward configuration, resolve its functions, print its hash")
    c.add_argument("config", help="a .toml or .json reward configuration")
    c.set_defaults(func=_check)

    r = cmds.add_parser("rescore", help="score stored rollouts under a configuration (old rewards are kept)")
    r.add_argument("--store", default=None, help="trace store URL (default: $LIGHTNING_STORE_URL)")
    r.add_argument("--config", required=True, help="the reward configuration (.toml / .json)")
    r.add_argument("--apply", choices=APPLY, default="unconsumed",
                   help="which rollouts' final_reward takes the new final reward (default: those no trainer "
                        "has taken; none: store beside; all: every one)")
    r.add_argument("--rollout", action="append", default=None, metavar="ID", help="only this rollout (repeat)")
    r.add_argument("--task", default=None, help="only this task's rollouts")
    r.add_argument("--mode", choices=("train", "val"), default=None)
    r.add_argument("--since", type=float, default=None, help="only rollouts created at or after (epoch seconds)")
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--reuse-model", action="store_true",
                   help="take a reward-model (or ranking-judge) value stored under this configuration "
                        "instead of asking again")
    r.set_defaults(func=_rescore)

    k = cmds.add_parser("calibrate", help="the reward model's values against human labels")
    k.add_argument("--store", default=None)
    k.add_argument("--config", default=None, help="only its reward-model values; print its scale/offset to use")
    k.set_defaults(func=_calibrate)

    lab = cmds.add_parser("label", help="serve the labelling page")
    lab.add_argument("--store", default=None)
    lab.add_argument("--config", default=None, help="queue its human interval first; combine after each label")
    lab.add_argument("--host", default="127.0.0.1", help="bind address (others need --token)")
    lab.add_argument("--port", type=int, default=8095)
    lab.add_argument("--token", default=None, help=f"bearer token for the API (or ${TOKEN_ENV})")
    lab.set_defaults(func=_label)


def _scorer(path: str | None) -> Scorer | None:
    return None if path is None else Scorer(load_config(path))


def _check(args: argparse.Namespace) -> int:
    scorer = _scorer(args.config)
    assert scorer is not None
    print(json.dumps({"config_hash": scorer.hash, "weights": scorer.config.weights,
                      "reward_type": scorer.config.reward_type, "on_error": scorer.config.on_error}, indent=1))
    return 0


def _rescore(args: argparse.Namespace) -> int:
    from lightning_middleware.rewards.rescore import rescore

    scorer = _scorer(args.config)
    assert scorer is not None
    store = open_store(args.store)
    try:
        report = rescore(store, scorer, rollout_ids=args.rollout, task_id=args.task, mode=args.mode, since=args.since,
                         limit=args.limit, apply=args.apply, reuse_model=args.reuse_model)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    finally:
        store.close()
    print(report.summary())
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from lightning_middleware.rewards.rescore import calibration

    scorer = _scorer(args.config)
    store = open_store(args.store)
    try:
        cal = calibration(store, config_hash=scorer.hash if scorer else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    finally:
        store.close()
    corr = "n/a" if cal.correlation is None else f"{cal.correlation:.3f}"
    rank = "n/a" if cal.rank_correlation is None else f"{cal.rank_correlation:.3f}"
    print(f"{cal.n} rollouts with both: bias (model - human) {cal.bias:+.4f}, human ~ {cal.slope:.4f} x model "
          f"{cal.intercept:+.4f}, correlation {corr}, rank correlation (agreement) {rank}")
    if scorer is not None and scorer.config.reward_model is not None:
        print("[reward_model] values that match the labels:\n" + cal.advice(scorer.config.reward_model))
    return 0


def _label(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from lightning_middleware.asgi.auth import checked_token, is_loopback
    from lightning_middleware.rewards.review import build_app

    try:
        token = checked_token(args.token or os.environ.get(TOKEN_ENV))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not is_loopback(args.host) and not token:
        raise UsageError(f"refusing to serve labels on {args.host} without a token: pass --token (or "
                         f"${TOKEN_ENV}), or bind 127.0.0.1")
    store = open_store(args.store)
    app = build_app(store, scorer=_scorer(args.config), token=token)
    log.info("labelling page on http://%s:%d/%s", args.host, args.port, "#token=..." if token else "")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m lightning_middleware.rewards.cli ...` = `lightning-mw rewards ...`."""
    from lightning_middleware.cli import run_command

    return run_command("rewards", add_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
