"""The reward proof's table (docs/rewards.md, "Proof") from demo output folders:

    python examples/rewards/proof_table.py --guards examples/rewards/hackable.toml \\
        hand=runs/proof-hand hybrid=runs/proof-hybrid hackable=runs/proof-hackable ...

Per run: held-out success before -> after RL (T=1, the task's own success, from results.json),
tool calls per held-out rollout and the share that ran out of guesses before -> after, and,
over the train rollouts of the last quarter of RL steps (by policy version), their success,
tool calls and the share that one fixed set of guards flags (`--guards`: a configuration whose
guards are scored in memory, nothing stored), so every run, whatever reward trained it, is
judged by the same detectors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lightning_middleware import TraceStore
from lightning_middleware.rewards import RewardConfig, Scorer
from lightning_middleware.rewards.trajectory import load_trajectories
from trainer_backend.demo.outcomes import SOLVED


def _measures(scorer: Scorer, trajectories: list[Any]) -> dict[str, float]:
    n = len(trajectories) or 1
    guards = [c.name for c in scorer.config.guards]
    flagged, fired = 0, dict.fromkeys(guards, 0)
    for t in trajectories:
        hits = [p.name for p in scorer.score(t).components if p.name in fired and (p.value or 0.0) > 0]
        flagged += bool(hits)
        for name in hits:
            fired[name] += 1
    solved = sum((t.reported_reward or 0.0) >= SOLVED for t in trajectories)
    return {"success": solved / n, "tool_calls": sum(len(t.tool_calls) for t in trajectories) / n,
            "out_of_guesses": sum(_end(t) == "out_of_guesses" for t in trajectories) / n,
            "flagged": flagged / n, "n": float(len(trajectories)), **{f"guard:{k}": v / n for k, v in fired.items()}}


def _end(t: Any) -> str | None:
    """How the demo agent says the episode ended (found, out_of_guesses, no_tool_call)."""
    own = [r for r in t.rewards if r.config_hash is None and r.call_index is None and r.agent is None]
    return (own[-1].metadata or {}).get("end") if own else None


def _flagged(m: dict[str, float]) -> str:
    each = ", ".join(f"{k[6:]} {v:.0%}" for k, v in m.items() if k.startswith("guard:"))
    return f"{m['flagged']:.1%} ({each})"


def run_row(label: str, out: Path, scorer: Scorer) -> dict[str, Any]:
    res = json.loads((out / "results.json").read_text())
    store = TraceStore(f"sqlite:///{out / 'traces.db'}", create=False)
    try:
        evals = {tag: [r for r in store.query_rollouts(mode="val") if r.metadata.get("eval") == tag]
                 for tag in ("before-t1", "after-t1")}
        held = {tag: _measures(scorer, load_trajectories(store, rs)) for tag, rs in evals.items()}
        steps = int(res["steps"])
        late = [r for r in store.query_rollouts(mode="train")
                if r.policy_version is not None and r.policy_version > 0.75 * steps]
        train = _measures(scorer, load_trajectories(store, late))
    finally:
        store.close()
    return {"label": label, "reward": (res.get("rewards") or {}).get("hash", "agent's own"), "steps": steps,
            "rl_min": res["timings"]["rl_s"] / 60, "before": res["before"]["sampled"]["success"],
            "after": res["after"]["sampled"]["success"], "held": held, "train": train}


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| run | reward (hash) | held-out success T=1 before -> after | tool calls / held-out rollout "
            "before -> after | out of guesses, held-out before -> after | flagged by the guards, held-out after "
            "| last quarter of RL: train success / tool calls / flagged | steps, RL minutes |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        hb, ha, tr = r["held"]["before-t1"], r["held"]["after-t1"], r["train"]
        lines.append(f"| {r['label']} | {r['reward']} | {r['before']:.1%} -> {r['after']:.1%} | "
                     f"{hb['tool_calls']:.2f} -> {ha['tool_calls']:.2f} | {hb['out_of_guesses']:.1%} -> "
                     f"{ha['out_of_guesses']:.1%} | {_flagged(ha)} | "
                     f"{tr['success']:.1%} / {tr['tool_calls']:.2f} / {_flagged(tr)} | "
                     f"{r['steps']}, {r['rl_min']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="LABEL=DIR: a demo output folder (results.json, traces.db)")
    p.add_argument("--guards", required=True, help="a reward configuration whose guards judge every run")
    args = p.parse_args()
    scorer = Scorer(RewardConfig.load(args.guards))
    rows = [run_row(label, Path(d), scorer) for label, _, d in (s.partition("=") for s in args.runs)]
    print(markdown(rows))


if __name__ == "__main__":
    main()
