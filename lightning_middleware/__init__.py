"""lightning-middleware: record what your agent's LLM calls do, and train on it with RL.

    client = wrap(OpenAI(base_url=...))
    with rollout("task-7") as r:
        ...agent code, unchanged...
        r.reward(1.0)
"""

from lightning_middleware.capture import agent_scope, emit_reward, propagate, rollout, rollout_headers, wrap
from lightning_middleware.records import LLMCall, Mode, PolicyVersion, Reward, Rollout, RolloutStatus, TrainStep
from lightning_middleware.rewards import RewardConfig, Score, Scorer
from lightning_middleware.store import StoreError, TraceStore

__version__ = "0.1.0"

__all__ = [
    "LLMCall",
    "Mode",
    "PolicyVersion",
    "Reward",
    "RewardConfig",
    "Rollout",
    "RolloutStatus",
    "Score",
    "Scorer",
    "StoreError",
    "TraceStore",
    "TrainStep",
    "agent_scope",
    "emit_reward",
    "propagate",
    "rollout",
    "rollout_headers",
    "wrap",
]
