"""Analysis for notebooks and the shell: a trace store as pandas DataFrames, summaries,
transcripts, dataset export.

    from lightning_middleware import analysis as A
    store = A.open_store("sqlite:///runs/traces.db")      # or a TraceStore, or None (env LIGHTNING_STORE_URL)
    rollouts = A.load_rollouts(store)                     # one row per rollout, with token/turn/latency columns
    A.success_by_task(rollouts)
    print(A.transcript(store, rollouts.rollout_id[0]).text())
    A.compare_reward_versions(store, "agent", "3f2a...")  # two reward versions side by side
    A.step_breakdown(store).median()                      # where a training step's time goes

Importing this package stays light: pandas is imported by the functions that need it.
"""

from lightning_middleware.analysis.drift_summary import DriftRow, DriftSummary, drift_summary, format_drift
from lightning_middleware.analysis.frames import (
                                                  DEFAULT_SUCCESS_THRESHOLD,
                                                  load_calls,
                                                  load_policy_versions,
                                                  load_rewards,
                                                  load_rollouts,
                                                  load_train_steps,
                                                  tokens_and_turns,
)
from lightning_middleware.analysis.metrics import (
                                                  ROLLOUT_PHASES,
                                                  STEP_PHASES,
                                                  best_and_worst,
                                                  latency_summary,
                                                  per_agent,
                                                  prefix_break_rate,
                                                  retries,
                                                  reward_by_policy_version,
                                                  reward_by_train_step,
                                                  row_stats,
                                                  step_breakdown,
                                                  success_by_task,
)
from lightning_middleware.analysis.transcripts import Transcript, TranscriptEntry, trained_spans, transcript
from lightning_middleware.analysis.versions import RewardComparison, compare_reward_versions, reward_versions
from lightning_middleware.store import open_store

__all__ = [
    "DEFAULT_SUCCESS_THRESHOLD",
    "DriftRow",
    "DriftSummary",
    "ROLLOUT_PHASES",
    "RewardComparison",
    "STEP_PHASES",
    "Transcript",
    "TranscriptEntry",
    "best_and_worst",
    "compare_reward_versions",
    "drift_summary",
    "format_drift",
    "latency_summary",
    "load_calls",
    "load_policy_versions",
    "load_rewards",
    "load_rollouts",
    "load_train_steps",
    "open_store",
    "per_agent",
    "prefix_break_rate",
    "retries",
    "reward_by_policy_version",
    "reward_by_train_step",
    "reward_versions",
    "row_stats",
    "step_breakdown",
    "success_by_task",
    "tokens_and_turns",
    "trained_spans",
    "transcript",
]
