"""lightning-middleware: record what your agent's LLM calls do, and train on it with RL.

    client = wrap(OpenAI(base_url=...))
    with rollout("task-7") as r:
        ...agent code, unchanged...
        r.reward(1.0)
"""

from .context import agent_scope, emit_reward, propagate, rollout, rollout_headers
from .records import LLMCall, Mode, PolicyVersion, Reward, Rollout, RolloutStatus, TrainStep
from .store import StoreError, TraceStore
from .wrap import wrap

__version__ = "0.1.0"

__all__ = [
    "LLMCall",
    "Mode",
    "PolicyVersion",
    "Reward",
    "Rollout",
    "RolloutStatus",
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
