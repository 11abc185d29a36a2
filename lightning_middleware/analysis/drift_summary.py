"""Drift between sampling and training in a store, per agent and task (`lightning-mw inspect --drift`).

Prefix breaks are recomputed from the stored calls (rows.py, as the trainer builds its rows); the
re-tokenising mismatches come from the trainer's per-step "drift" events, since re-rendering a
request needs the trainer's tokenizer; "template_mismatch" events are the served-template checks
that failed (serving/parity.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lightning_middleware.records import Event
from lightning_middleware.rows import build_rows
from lightning_middleware.store import TraceStore, open_store


@dataclass(frozen=True)
class DriftRow:
    agent: str  # "" for calls without an agent name
    task_id: str
    chances: int = 0  # calls that followed one of the same agent's calls
    prefix_breaks: int = 0
    retokenized: int = 0  # calls the trainer re-rendered (a sample per step)
    retokenize_mismatches: int = 0

    @property
    def prefix_break_rate(self) -> float:
        return self.prefix_breaks / self.chances if self.chances else 0.0

    @property
    def mismatch_share(self) -> float:
        return self.retokenize_mismatches / self.retokenized if self.retokenized else 0.0


@dataclass(frozen=True)
class DriftSummary:
    rows: tuple[DriftRow, ...]
    template_mismatches: tuple[Event, ...]
    rollouts: int


def drift_summary(store: TraceStore | str | None = None, *, limit: int = 2000) -> DriftSummary:
    """Per (agent, task) over the newest `limit` finished rollouts, and every template mismatch event."""
    st = open_store(store)
    rollouts = [r for r in st.query_rollouts(newest_first=True, limit=limit) if r.status != "running"]
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for start in range(0, len(rollouts), 200):  # a bounded query each
        chunk = rollouts[start:start + 200]
        calls = st.calls_for([r.id for r in chunk])
        for r in chunk:
            _rows, stats = build_rows(calls.get(r.id, []), rollout_id=r.id, task_id=r.task_id)
            for agent, (breaks, chances) in stats.agent_prefix_breaks().items():
                c = counts[(agent, r.task_id)]
                c[0] += chances
                c[1] += breaks
    for event in st.events(kind="drift"):
        for agent, task, checked, differing in event.data.get("retokenize", []):
            c = counts[(str(agent), str(task))]
            c[2] += int(checked)
            c[3] += int(differing)
    rows = tuple(DriftRow(a, t, *c) for (a, t), c in sorted(counts.items()))
    return DriftSummary(rows, tuple(st.events(kind="template_mismatch")), len(rollouts))


def format_drift(summary: DriftSummary) -> str:
    lines = [f"drift over {summary.rollouts} finished rollouts",
             f"  {'agent':16s} {'task':24s} {'breaks':>13s} {'rate':>6s} {'re-tokenised':>16s} {'share':>6s}"]
    for r in summary.rows:
        lines.append(f"  {r.agent or '-':16s} {r.task_id[:24]:24s} {r.prefix_breaks:>6d} of {r.chances:<4d} "
                     f"{r.prefix_break_rate:>6.1%} {r.retokenize_mismatches:>6d} of {r.retokenized:<6d} "
                     f"{r.mismatch_share:>6.1%}")
    if not summary.rows:
        lines.append("  (no calls)")
    lines.append(f"template mismatches: {len(summary.template_mismatches)}")
    for e in summary.template_mismatches:
        allowed = " (allowed)" if e.data.get("allowed") else ""
        lines.append(f"  step {e.step if e.step is not None else '-'}{allowed}: {e.message}")
    return "\n".join(lines)
