"""`lightning-mw demo --task rg:NAME`: SmolLM2-135M-Instruct learns a reasoning-gym dataset with RL,
scored by the dataset's own `score_answer`.

    lightning-mw demo --task "rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1"

The address names the dataset and its own config keys (lightning_middleware/benchmarks/reasoning.py);
the demo sets each split's size and seed:

- train: `size = train_tasks`, seed `split_seed(TRAIN_SEED, seed)`;
- warm start: seed `split_seed(SFT_SEED, warm_start_seed)`, items shown with their answers;
- held out: `eval_tasks` items of seed `split_seed(EVAL_SEED, seed)`, a seed never trained on, each asking a
  question that no train or warm-start item asks, and none asked twice. Seeds alone do not keep
  items apart: a small dataset draws the same questions again (chain_sum with 2-3 one-digit terms:
  166 of a seed's first 256 items appear among another seed's 4,096), so `held_out` skips them.

The agent is a LangChain chat model, `wrap()`ed, asked once with a system prompt that wants the
answer inside `<answer>` tags; it returns nothing. The reward configuration (`rg_score`,
`agent_reward = false`) scores the rollout's final output with the dataset's `score_answer`, partial
credit included; a held-out item counts as solved only at score 1.0. The warm start (a LoRA SFT on
`SFT_STEPS` x 4 items answered in tags, merged) teaches the answer format, as the arithmetic and
BFCL tasks' teach their tool calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from typing import Any

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.benchmarks import reasoning
from lightning_middleware.controller import RolloutResult
from trainer_backend.demo.run import DemoConfig
from trainer_backend.demo.smol import POLICY, REQUEST_TIMEOUT_S, SmolDemoRun
from trainer_backend.demo.smol_warm import Demonstration

SYSTEM = "Answer the question. Give only the final answer, inside <answer></answer> tags."
RULES: dict[str, Any] = {"rules": {"rg": {"function": "lightning_middleware.benchmarks.reasoning:rg_score",
                                          "weight": 1.0}},
                         "agent_reward": False}
TRAIN_SEED, EVAL_SEED, SFT_SEED = 0, 1_000_000, 2_000_000  # each split its own seeds (and held_out)
# reasoning-gym draws item i of dataset seed S from Random(S + i): seed 1's items would be seed 0's
# shifted by one, so a run's seed moves its splits by more than any split draws (held_out: <= 4,096
# for 64 items, 16,384 for 256) and than the bases above are apart.
SEED_STRIDE = 10_000_000
SFT_STEPS = 6
MAX_TOKENS = 64


def split_seed(base: int, seed: int) -> int:
    """The dataset seed of a split (`base`: TRAIN_SEED, EVAL_SEED or SFT_SEED) for a run's `seed`."""
    return base + seed * SEED_STRIDE


def split(address: str, size: int, seed: int) -> str:
    """`address` (rg:NAME with the dataset's config keys) with this split's size and seed."""
    a = reasoning.parse(address)
    return str(reasoning.Address(a.name, size, seed, a.config))


def held_out(address: str, size: int, seed: int, seen: Collection[str]) -> tuple[list[dict[str, Any]], int]:
    """The first `size` items of seed `seed` whose question is not in `seen` (the train and
    warm-start questions) and not asked by an earlier one; with how many items were skipped.
    reasoning-gym's item i of a seed is the same at any size, so the walk is deterministic."""
    if size < 1:  # no walk ends at 0 items found
        raise ValueError(f"held-out size must be at least 1, got {size}")
    seen = set(seen)
    limit = max(64 * size, 4096)  # chain_sum's 2-3 one-digit terms: ~1 novel question in 3 items
    n = 2 * size
    while True:
        found: list[dict[str, Any]] = []
        asked = set(seen)
        candidates = reasoning.tasks(split(address, n, seed))
        for i, task in enumerate(candidates):
            if task["question"] not in asked:
                asked.add(task["question"])
                found.append(task)
                if len(found) == size:
                    return found, i + 1 - size
        if n >= limit:
            raise reasoning.BenchmarkError(
                f"{address}: only {len(found)} of {n} held-out items ask a question that no train or warm-start "
                f"item asks; the dataset is too small for {size} held-out items (fewer --eval-tasks, or a "
                f"larger config)")
        n = min(2 * n, limit)


def demonstrations_for(address: str) -> Callable[[int, int], list[Demonstration]]:
    """The warm start's demonstrations: `n` items of the SFT seed, answered in tags."""
    def demonstrations(n: int, seed: int) -> list[Demonstration]:
        a = reasoning.parse(split(address, n, split_seed(SFT_SEED, seed)))
        ds = reasoning.dataset(a)
        return [([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ds[i]["question"]},
                  {"role": "assistant", "content": f"<answer>{ds[i]['answer']}</answer>"}], [])
                for i in range(n)]

    return demonstrations


def outcomes(store: TraceStore, results: list[RolloutResult]) -> dict[str, Any]:
    """Solved (score 1.0), the mean score (partial credit), and the share of answers in tags."""
    tagged, scores = 0, []
    for r in results:
        calls = store.calls(r.rollout_id)
        reply = (calls[-1].response or {}) if calls else {}
        text = str(((reply.get("choices") or [{}])[0].get("message") or {}).get("content") or "")
        tagged += int("<answer>" in text and "</answer>" in text)
        scores.append(r.reward or 0.0)
    n = max(1, len(results))
    return {"success": sum(1 for s in scores if s >= 1.0) / n, "n": len(results), "mean_score": sum(scores) / n,
            "tagged": tagged / n, "errors": sum(1 for r in results if r.status != "succeeded")}


def make_rg_agent(base_url: str, store: TraceStore | None, model: str = POLICY, max_tokens: int = MAX_TOKENS) -> Any:
    """An async agent for the controller: one question, one answer, at the task's temperature."""
    from lightning_middleware.benchmarks.chat import chat_per_loop

    chat = chat_per_loop(base_url, model=model, store=store, timeout_s=REQUEST_TIMEOUT_S, max_tokens=max_tokens)

    async def agent(task: dict[str, Any]) -> None:
        await chat().bind(temperature=float(task.get("temperature", 1.0))).ainvoke(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}])

    return agent


class ReasoningDemoRun(SmolDemoRun):
    """The SmolLM2 demo's steps on a reasoning-gym dataset: its items, its scorer, its warm start."""

    sft_steps = SFT_STEPS
    task_noun = "items, none asking a question a train or warm-start item asks"
    format_key = ("tagged", "answer in tags")
    outcomes = staticmethod(outcomes)

    def __init__(self, cfg: DemoConfig) -> None:
        address = self.address = str(cfg.extra["rg"])  # before the split, which reads it
        super().__init__(cfg)
        # the cache names the dataset and its config: another task is another warm start
        name = reasoning.parse(address).name
        self.warm_start_name = f"smol-rg-{name}-{hashlib.sha256(split(address, 1, 0).encode()).hexdigest()[:8]}"
        self.reward_config = RewardConfig.from_dict(RULES)
        self.results["rewards"] = {"config": self.reward_config.describe(), "hash": self.reward_config.hash}

    def _split(self) -> None:
        cfg = self.cfg
        self.train_tasks = reasoning.tasks(split(self.address, cfg.train_tasks, split_seed(TRAIN_SEED, cfg.seed)))
        seen = {t["question"] for t in self.train_tasks} | self._shown_questions()
        self.eval_tasks, skipped = held_out(self.address, cfg.eval_tasks, split_seed(EVAL_SEED, cfg.seed), seen)
        self.results["held_out"] = {"items": len(self.eval_tasks), "skipped_seen_or_repeated": skipped}

    def _demonstrations(self) -> Callable[[int, int], list[Demonstration]]:
        return demonstrations_for(self.address)

    def _agent(self, base_url: str, store: TraceStore) -> Any:
        return make_rg_agent(base_url, store)
