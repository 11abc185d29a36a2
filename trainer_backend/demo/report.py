"""The demo's reward curve: training success per step against minutes of RL, with the held-out
evaluations before and after; one run or several in one image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TITLES = {"guess": "guess-the-number agent (LangChain), rollout-level GRPO",
          "team": "a two-agent LangGraph team, a LoRA policy per role",
          "arith": "SmolLM2-135M-Instruct, calculator agent (LangChain), GRPO"}


def plot_curve(results: dict[str, Any] | list[tuple[str, dict[str, Any]]], path: str | Path, smooth: int = 5) -> Path:
    """Training success per step (and its moving average) against minutes of RL, with the
    held-out before/after evaluations. Several runs: pass [(label, results), ...]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results if isinstance(results, list) else [("train batches", results)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (label, res) in enumerate(runs):
        color = f"C{k}"
        curve = res.get("curve", [])
        t = [c["t_s"] / 60 for c in curve]
        curve = [c for c in curve if c["success"] == c["success"]]
        t = [c["t_s"] / 60 for c in curve]
        y = [c["success"] for c in curve]
        ax.plot(t, y, color=color, alpha=0.25, lw=1)
        ma = [sum(y[max(0, i - smooth + 1):i + 1]) / len(y[max(0, i - smooth + 1):i + 1]) for i in range(len(y))]
        ax.plot(t, ma, color=color, lw=2, label=f"{label} (moving avg {smooth})")
        # the evaluation after RL sits where RL ended (a step budget may end it before the time cap)
        end = res.get("timings", {}).get("rl_s", 60 * res["config"]["minutes"]) / 60
        for tag, x in (("before", 0.0), ("after", end)):
            if tag in res:
                ax.scatter([x], [res[tag]["sampled"]["success"]], color=color, marker="o", zorder=5, s=40)
        if "before" in res and "after" in res:
            b, a = res["before"]["sampled"]["success"], res["after"]["sampled"]["success"]
            ax.text(0.02, 0.95 - 0.07 * k, f"{label}: held-out (dots) {b:.1%} -> {a:.1%}", color=color,
                    transform=ax.transAxes, fontsize=8, va="top")
    ax.set_xlabel("minutes of RL")
    ax.set_ylabel("success (train rollouts, T=1)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("lightning-mw demo: " + TITLES.get(runs[0][1]["config"].get("task"), TITLES["guess"]))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
