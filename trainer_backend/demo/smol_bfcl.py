"""`lightning-mw demo --task bfcl`: SmolLM2-135M-Instruct learns BFCL function calling with RL.

The agent is `lightning_middleware.benchmarks.bfcl.make_agent` (LangChain's ChatOpenAI with the
item's BFCL functions bound as tools, `wrap()`ed); every rollout is scored by BFCL's own AST
checker through the reward configuration (`bfcl_score`, `agent_reward = false`), so the trainer
learns from the benchmark's verdict and never from the agent.

- Train: the train splits of `simple_python` and `multiple` (`bfcl:...?split=train`, 453 items),
  shuffled by the seed.
- Held out: the test splits of the same categories (147 items), greedy and at T=1, and
  `live_simple`'s test split (52 items of a category never trained on), greedy.
- Warm start: the untouched model makes no call at all on these items (0/100, docs/benchmarks.md),
  so RL would see no reward; a LoRA SFT on train-split items answered with their reference calls
  (`demonstrations`), merged, comes first, as the arithmetic task's does. The test splits are never
  shown.

Everything else (serving, the trainer, hot swaps, the episode guard) is the arithmetic task's
(smol.py).
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
from collections.abc import Callable
from typing import Any

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.benchmarks import bfcl
from lightning_middleware.controller import RolloutResult
from trainer_backend.demo.run import DemoConfig
from trainer_backend.demo.smol import POLICY, SmolDemoRun
from trainer_backend.demo.smol_warm import Demonstration

TRAIN = ("bfcl:simple_python?split=train", "bfcl:multiple?split=train")
HELD_OUT = ("bfcl:simple_python?split=test", "bfcl:multiple?split=test")
UNSEEN = "bfcl:live_simple?split=test"  # a category the run never trains on
RULES: dict[str, Any] = {"rules": {"bfcl": {"function": "lightning_middleware.benchmarks.bfcl:bfcl_score",
                                            "weight": 1.0}},
                         "agent_reward": False}
# 12 x 4 demonstrations: 23% greedy on simple_python's test split from 0% (docs/benchmarks.md)
SFT_STEPS = 12
MAX_TOKENS = 256  # a call with its arguments; BFCL's longest reference calls are ~150 tokens
MAX_MODEL_LEN = 4096  # the longest `multiple` prompt (its functions' schemas) is ~2,300 tokens


def demonstrations(n: int, seed: int) -> list[Demonstration]:
    """`n` train-split items answered with BFCL's reference calls, as SmolLM2's tool-call turn."""
    tasks = [t for address in TRAIN for t in bfcl.tasks(address)]
    random.Random(seed).shuffle(tasks)
    out = []
    for i, task in enumerate(tasks[:n]):
        calls = [{"id": f"call_{i}_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                 for k, (name, args) in enumerate(bfcl.reference_calls(task))]
        out.append(([*task["messages"], {"role": "assistant", "content": "", "tool_calls": calls}], task["tools"]))
    return out


def warm_start_name() -> str:
    """The warm start's cache prefix, naming the train split it was shown (a changed split is a
    new warm start, never a stale one that saw today's held-out items)."""
    ids = sorted(t["task_id"] for address in TRAIN for t in bfcl.tasks(address))
    return "smol-bfcl-warm-" + hashlib.sha256(",".join(ids).encode()).hexdigest()[:8]


def rewards_problem(config: RewardConfig, path: str | None) -> str | None:
    """Why the `--rewards` configuration at `path` cannot train a BFCL run, or None: the evaluations
    read its `bfcl` rule's verdict (examples/rewards/bfcl-stages.toml: partial credit by the checker's stage)."""
    if "bfcl" in config.weights:
        return None
    return (f"--rewards {path}: a BFCL run's configuration needs a `bfcl` rule "
            "(lightning_middleware.benchmarks.bfcl:bfcl_score or :bfcl_stages); it has " + ", ".join(config.weights))


def outcomes(store: TraceStore, results: list[RolloutResult]) -> dict[str, Any]:
    """BFCL accuracy of finished rollouts (its checker's verdict), the share with a call at all and
    with calls BFCL could check, and the checker's error types (from the `bfcl` reward each rollout
    was given)."""
    kinds: collections.Counter[str] = collections.Counter()
    for r in results:
        detail: dict[str, Any] = next((w.metadata.get("detail", {}) for w in store.rewards(r.rollout_id)
                                       if w.name == "bfcl"), {})
        kinds[str(detail.get("error_type") or ("valid" if detail.get("valid") else r.status))] += 1
    n = max(1, len(results))
    called = len(results) - kinds["no_call"] - sum(v for k, v in kinds.items() if k in ("failed", "timeout"))
    checkable = called - kinds["malformed_arguments"]
    # BFCL's verdict, not the reward: a configuration with partial credit pays invalid answers too
    return {"success": kinds["valid"] / n, "n": len(results),
            "a_call": called / n, "valid_tool_call": checkable / n,
            "errors": sum(1 for r in results if r.status != "succeeded"), "error_types": dict(kinds.most_common())}


class BfclDemoRun(SmolDemoRun):
    """The SmolLM2 demo's steps on BFCL: its tasks, its checker as the reward, its warm start."""

    sft_steps = SFT_STEPS
    max_model_len = MAX_MODEL_LEN
    task_noun = "BFCL items"

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__(cfg)
        self.unseen_tasks = bfcl.tasks(UNSEEN)
        self.warm_start_name = warm_start_name()  # the cache bench/bench_bfcl.py's --warm-start shares
        # the benchmark's checker scores every rollout; the agent's own word is refused. A
        # configuration of the user's (`--rewards`) must keep a `bfcl` rule (rewards_problem).
        if self.reward_config is None:
            self.reward_config = RewardConfig.from_dict(RULES)
            self.results["rewards"] = {"config": self.reward_config.describe(), "hash": self.reward_config.hash}
        elif problem := rewards_problem(self.reward_config, cfg.rewards):
            raise ValueError(problem)

    def _split(self) -> None:
        # BFCL's own split (TRAIN and HELD_OUT are disjoint item lists: no question in both)
        train = [t for address in TRAIN for t in bfcl.tasks(address)]
        random.Random(f"bfcl:train:{self.cfg.seed}").shuffle(train)
        self.train_tasks = train
        held_out = [t for address in HELD_OUT for t in bfcl.tasks(address)]
        self.eval_tasks = held_out[:self.cfg.eval_tasks]

    def _demonstrations(self) -> Callable[[int, int], list[Demonstration]]:
        return demonstrations

    def _agent(self, base_url: str, store: TraceStore) -> Any:
        # T=1 unless the task says: the training rollouts sample (a group of greedy answers is one
        # answer four times, and carries no signal); the evaluation passes set their own
        return bfcl.make_agent(base_url, model=POLICY, store=store, max_tokens=MAX_TOKENS, temperature=1.0)

    outcomes = staticmethod(outcomes)

    def evaluate(self, tag: str) -> dict[str, Any]:
        res = super().evaluate(tag)
        if self.cfg.greedy:
            res["unseen_greedy"] = unseen = self._evaluate_pass(self.unseen_tasks, 0.0, f"{tag}-unseen-greedy")
            self._say_pass(f"greedy, {UNSEEN} (never trained on)", unseen)
        return res
