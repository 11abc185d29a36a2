"""Drift between what was sampled and what is trained, measured every step.

Two signals, per agent:

    prefix breaks   a call that did not extend its agent's previous prompt token for token, so the
                    two could not merge into one row (rows.py): a template that re-renders history
                    differently from what the model saw (reasoning dropped, tool calls re-serialised)
    re-tokenising   the share of a sample of the step's calls whose stored prompt IDs differ from the
                    trainer's own rendering of the stored request (serving/parity.py's
                    `render_request`): the trainer's and the server's templates have parted

Both go into the step's metrics (`prefix_break_rate/AGENT`, `retokenize_mismatch_share/AGENT`),
the health checks turn them into warnings (monitoring.py), and a "drift" event per step keeps the
counts per agent and task for `lightning-mw inspect --drift`. After each publish `after_publish`
checks the served model again (`TemplateParity`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_middleware import Rollout, TraceStore
from lightning_middleware.records import Event, LLMCall
from lightning_middleware.rows import RowStats, counted_attempts
from trainer_backend.serving.parity import TemplateMismatch, TemplateParity, render_request

log = logging.getLogger(__name__)

SAMPLE_CALLS = 64  # re-tokenised per step: enough to see a share of 5%, cheap beside a step


class DriftWatch:
    """The drift metrics of a step, and the served template checked after a publish."""

    def __init__(self, store: TraceStore, *, tokenizer: Any | None = None, parity: TemplateParity | None = None,
                 source: str | None = None) -> None:
        self.store = store
        self.parity = parity
        self.tokenizer = tokenizer if tokenizer is not None else (parity.tokenizer if parity else None)
        self.source = source

    def measure(self, rollouts: Sequence[Rollout], calls: Mapping[str | None, Sequence[LLMCall]],
                row_stats: RowStats) -> tuple[dict[str, float], dict[str, Any]]:
        """(metrics, the drift event's data) of one step's batch."""
        metrics: dict[str, float] = {}
        breaks = row_stats.agent_prefix_breaks()
        for agent, (n, chances) in breaks.items():
            metrics[f"prefix_break_rate/{agent or '-'}"] = n / chances if chances else 0.0
            metrics[f"prefix_chances/{agent or '-'}"] = float(chances)
        data: dict[str, Any] = {"prefix_breaks": {a: list(v) for a, v in breaks.items()}}
        if self.tokenizer is not None:
            checked, differing = self._retokenize(rollouts, calls)
            for agent in sorted({a for a, _ in checked}):
                n = sum(v for (a, _), v in checked.items() if a == agent)
                bad = sum(v for (a, _), v in differing.items() if a == agent)
                metrics[f"retokenize_checked/{agent or '-'}"] = float(n)
                metrics[f"retokenize_mismatch_share/{agent or '-'}"] = bad / n if n else 0.0
            data["retokenize"] = [[a, t, n, differing.get((a, t), 0)] for (a, t), n in sorted(checked.items())]
        return metrics, data

    def record(self, step: int, data: dict[str, Any]) -> None:
        self.store.add_event(Event(kind="drift", message="prefix breaks and re-tokenising of the step's calls",
                                   source=self.source, step=step, data=data))

    def after_publish(self, version: int, step: int) -> None:
        """Check the served model again (a full reload serves the checkpoint's own tokenizer files);
        a mismatch is an event, then a refusal unless mismatches are allowed (`TemplateParity.require`)."""
        if self.parity is None:
            return
        when = f"after publishing version {version}"
        try:
            report = self.parity.require(when)
        except TemplateMismatch as exc:
            self._mismatch_event(str(exc), version, step)
            raise
        if not report.ok:
            self._mismatch_event(report.message(when), version, step)

    def _mismatch_event(self, message: str, version: int, step: int) -> None:
        assert self.parity is not None
        self.store.add_event(Event(kind="template_mismatch", message=message, source=self.source, step=step,
                                   data={"version": version, "allowed": self.parity.allow_mismatch}))

    def _retokenize(self, rollouts: Sequence[Rollout], calls: Mapping[str | None, Sequence[LLMCall]]
                    ) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
        """Per (agent, task): calls checked, and those whose stored prompt IDs differ."""
        checked: Counter[tuple[str, str]] = Counter()
        differing: Counter[tuple[str, str]] = Counter()
        total = 0
        for r in rollouts:
            for call in counted_attempts(list(calls.get(r.id, ()))):
                if total >= SAMPLE_CALLS:
                    return checked, differing
                if not call.prompt_token_ids or not call.request.get("messages"):
                    continue  # text completions, or a call recorded without its token IDs
                try:
                    ids = render_request(self.tokenizer, call.request)
                except Exception as exc:  # noqa: BLE001 - a request the template cannot render is drift too
                    log.debug("cannot re-render call %s: %s", call.id, exc)
                    ids = []
                key = (call.agent_name or "", r.task_id or "")
                checked[key] += 1
                total += 1
                differing[key] += tuple(ids) != tuple(call.prompt_token_ids)
        return checked, differing
