"""`lightning-mw inspect`: a quick look at a trace store from the shell."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_middleware.analysis.drift_summary import drift_summary, format_drift
from lightning_middleware.store import TraceStore, default_store_url, open_store


def add_cli(sub: Any) -> None:
    p = sub.add_parser("inspect", help="summarise a trace store, or show one rollout's calls")
    p.add_argument("--store", default=None, help=f"store URL (default {default_store_url()})")
    p.add_argument("rollout_id", nargs="?", help="show this rollout's calls")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--drift", action="store_true",
                   help="prefix breaks and re-tokenising mismatches per agent and task, and template mismatches")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    if args.drift:
        print(format_drift(drift_summary(store)))
        return 0
    if args.rollout_id:
        return _show_rollout(store, args.rollout_id)
    print(f"store: {store.safe_url}")
    for table in ("rollouts", "llm_calls", "rewards", "policy_versions", "train_steps"):
        print(f"  {table:16s} {store.count(table)}")
    for r in store.query_rollouts(newest_first=True, limit=args.limit):
        print(f"  {r.id[:12]}  {r.task_id[:24]:24s} {r.mode:5s} {r.status:9s} reward={r.final_reward}")
    return 0


def _show_rollout(store: TraceStore, rollout_id: str) -> int:
    r = store.get_rollout(rollout_id)
    if r is None:
        print(f"no rollout {rollout_id!r} in {store.safe_url}")
        return 1
    print(json.dumps({k: v for k, v in r.__dict__.items()}, default=str, indent=2))
    for w in store.rewards(rollout_id):
        where = "".join([f" call={w.call_index}" if w.call_index is not None else "",
                         f" agent={w.agent}" if w.agent is not None else "",
                         f" config={w.config_hash}" if w.config_hash is not None else ""])
        print(f"- reward {w.name or '-'} = {w.value:g}{' final' if w.final else ''}{where}"
              f"{' late' if w.metadata.get('late') else ''}")
    for c in store.calls(rollout_id):
        message = ((c.response or {}).get("choices") or [{}])[0].get("message") or {}
        print(f"- call {c.call_index} attempt {c.attempt} {c.endpoint} status={c.status_code} "
              f"training={c.is_training} prompt={len(c.prompt_token_ids)} completion={len(c.completion_token_ids)} "
              f"tokens: {json.dumps(message.get('content'))[:80]}")
    return 0
