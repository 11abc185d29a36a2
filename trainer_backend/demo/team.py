"""`lightning-mw demo --task team`: two LangGraph agents, each with its own LoRA policy and reward.

The team plays one guess-the-number game (demo/task.py) as a LangGraph graph of two nodes:

    scout   makes the first SCOUT_GUESSES guesses: its job is to narrow the range the way exact
            bisection does (8, then 4 or 12). Its reward: the number is found, or at most
            GOOD_RANGE numbers are still consistent with the answers when it hands over.
    closer  gets the conversation and the remaining guesses: its job is to finish. Its reward:
            the number is found.

The roles need different behaviour (opening moves against end-game moves, from different
positions of the tree) and get different rewards. The graph's node names are the agent names
(adapters/langchain.py), and `wrap(..., policies=...)` sends each node's calls to its own
adapter on one vLLM server whatever model name the code wrote; the trainer trains each
adapter on its own rows, with advantages over (task, policy) groups and each agent's own
reward (`emit_reward(..., agent=...)`). `--shared-policy` trains one adapter for both roles
under the same budget, for comparison. Both start from the main demo's warm start.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypedDict

from lightning_middleware import TraceStore, wrap
from lightning_middleware.controller import RolloutController
from trainer_backend.demo.agent import SERVED_NAME, guess_tool
from trainer_backend.demo.run import DemoRun, say
from trainer_backend.demo.task import HIGH, LOW, MAX_GUESSES, SYSTEM, USER, answer
from trainer_backend.serving.publisher import WeightPublisher
from trainer_backend.serving.server import VLLMServer

if TYPE_CHECKING:  # torch is imported when training starts
    from trainer_backend.engines.policies import PolicySet
    from trainer_backend.engines.torch_config import TorchEngineConfig

ROLES = ("scout", "closer")
SHARED = "team"  # the one adapter both roles use with --shared-policy
SCOUT_GUESSES = 2
GOOD_RANGE = 3  # what exact bisection leaves after two guesses on 1..15
LORA_RANK = 16


def consistent_range(secret: int, guesses: list[int]) -> int:
    """How many numbers are still possible after these guesses' answers (0 once found)."""
    lo, hi = LOW, HIGH
    for g in guesses:
        if g == secret:
            return 0
        if LOW <= g <= HIGH:
            lo, hi = (max(lo, g + 1), hi) if secret > g else (lo, min(hi, g - 1))
    return hi - lo + 1


def role_rewards(secret: int, guesses: list[int], scout_turns: int) -> dict[str, float]:
    """Each role's reward for one game: the scout for its narrowing, the closer for the find."""
    found = secret in guesses
    scouted = guesses[:scout_turns]
    return {"scout": float(secret in scouted or consistent_range(secret, scouted) <= GOOD_RANGE),
            "closer": float(found)}


def policies_of(shared: bool) -> dict[str, str]:
    """Agent name -> served adapter name."""
    return {role: SHARED if shared else role for role in ROLES}


class _State(TypedDict):
    messages: list[Any]
    guesses: list[int]
    secret: int
    temperature: float
    scout_turns: int
    done: bool


def make_team_agent(base_url: str, store: TraceStore, policies: dict[str, str]) -> Any:
    """The team as a LangGraph graph; an async agent function for the rollout controller."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    from lightning_middleware import emit_reward

    llm = wrap(ChatOpenAI(model=SERVED_NAME, base_url=base_url, api_key="-", temperature=1.0, max_tokens=48,
                          timeout=120, max_retries=2), store=store, policies=policies,
               exact_history=True)  # the one line (exact_history: demo/agent.py)
    policy = llm.bind_tools([guess_tool()])

    async def play(state: _State, turns: int) -> dict[str, Any]:
        messages, guesses = list(state["messages"]), list(state["guesses"])
        for _ in range(turns):
            ai = await policy.ainvoke(messages, temperature=state["temperature"])
            messages.append(ai)
            if not ai.tool_calls:
                return {"messages": messages, "guesses": guesses, "done": True}
            call = ai.tool_calls[0]
            n = call["args"].get("n")
            result = answer(state["secret"], n)
            guesses.append(int(n) if result != "invalid" and n is not None else -1)
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
            if result == "correct":
                return {"messages": messages, "guesses": guesses, "done": True}
        return {"messages": messages, "guesses": guesses, "done": False}

    async def scout(state: _State) -> dict[str, Any]:
        out = await play(state, SCOUT_GUESSES)
        return {**out, "scout_turns": len(out["guesses"])}

    async def closer(state: _State) -> dict[str, Any]:
        return await play(state, MAX_GUESSES - len(state["guesses"]))

    graph = StateGraph(_State)
    graph.add_node("scout", scout)
    graph.add_node("closer", closer)
    graph.add_edge(START, "scout")
    graph.add_conditional_edges("scout", lambda s: END if s["done"] else "closer")
    graph.add_edge("closer", END)
    team = graph.compile()

    async def agent(task: dict[str, Any]) -> dict[str, Any]:
        state = await team.ainvoke({"messages": [SystemMessage(SYSTEM), HumanMessage(USER)], "guesses": [],
                                    "secret": task["secret"], "temperature": float(task.get("temperature", 1.0)),
                                    "scout_turns": 0, "done": False})
        rewards = role_rewards(task["secret"], state["guesses"], state["scout_turns"])
        for role, value in rewards.items():
            emit_reward(value, agent=role)  # each role's own reward; the rollout's is the team's
        return {"reward": rewards["closer"], **{f"{r}_reward": v for r, v in rewards.items()},
                "guesses": len(state["guesses"])}

    return agent


def evaluate_team(controller: RolloutController, store: TraceStore, tasks: list[dict[str, Any]], *,
                  temperature: float, tag: str) -> dict[str, Any]:
    """Held-out success of the team and of each role (mode="val": never trained on)."""
    t0 = time.perf_counter()
    batch = [dict(t, temperature=temperature, task_id=f"{t['task_id']}-{tag}") for t in tasks]
    results = controller.run(batch, n=1, mode="val", metadata={"eval": tag})
    roles: dict[str, list[float]] = {role: [] for role in ROLES}
    closer_after_good_scout = []
    for r in results:
        final = [w for w in store.rewards(r.rollout_id) if w.final and w.agent is None]
        meta = final[-1].metadata if final else {}
        for role in ROLES:
            roles[role].append(float(meta.get(f"{role}_reward", 0.0)))
        if meta.get("scout_reward") == 1.0:
            closer_after_good_scout.append(float(meta.get("closer_reward", 0.0)))
    n = len(results)
    return {"success": sum(1 for r in results if (r.reward or 0.0) >= 1.0) / n, "n": n,
            "errors": sum(1 for r in results if r.status != "succeeded"), "temperature": temperature,
            **{f"{role}_success": sum(v) / n for role, v in roles.items()},
            # the closer's own skill: how often it finishes when the scout did its part
            "closer_success_after_good_scout": (sum(closer_after_good_scout) / len(closer_after_good_scout)
                                                if closer_after_good_scout else float("nan")),
            "seconds": time.perf_counter() - t0}


class TeamDemoRun(DemoRun):
    """The demo's steps with the team: adapters served by name, a PolicySet trained."""

    _policies: PolicySet | None = None

    @property
    def shared(self) -> bool:
        return self.cfg.shared_policy

    def _server(self) -> VLLMServer:
        assert self.model_dir is not None
        return VLLMServer(self.model_dir, dtype="float32", served_model_name=SERVED_NAME, max_model_len=1024,
                          log_path=self.out / "vllm.log", extra_args=["--max-num-seqs", "256"],
                          max_lora_rank=LORA_RANK, max_loras=len(ROLES), all_cores=True)

    def _agent(self, base_url: str, store: TraceStore) -> Any:
        return make_team_agent(base_url, store, policies_of(self.shared))

    def serve(self) -> None:
        super().serve()
        # the adapters at version 0 (the warm start exactly) are served before the baseline
        self._policies = self._engine(self._engine_config())
        self._publisher().publish(self._policies.save(self.out / "checkpoints" / "v000000"), 0)
        self.results["policies"] = policies_of(self.shared)

    def _engine(self, config: TorchEngineConfig) -> PolicySet:
        """One LoRA adapter per role (or one for both), built once, in serve()."""
        from trainer_backend.engines.lora import AdapterConfig
        from trainer_backend.engines.policies import PolicySet

        if self._policies is None:
            assert self.model_dir is not None
            names = sorted(set(policies_of(self.shared).values()))
            self._policies = PolicySet(self.model_dir, names,
                                       replace(config, lora=AdapterConfig(rank=LORA_RANK, alpha=LORA_RANK)))
        return self._policies

    def _publisher(self) -> WeightPublisher:
        assert self.server is not None
        return WeightPublisher(self.server.url, pause=self.cfg.publish_pause)

    def evaluate(self, tag: str) -> dict[str, Any]:
        assert self.controller is not None and self.store is not None
        say(f"{'[3/5] baseline' if tag == 'before' else '[5/5] after RL: evaluating'} of the team "
            f"on {len(self.eval_tasks)} held-out tasks")
        res = {"sampled": evaluate_team(self.controller, self.store, self.eval_tasks, temperature=1.0,
                                        tag=f"{tag}-t1")}
        if self.cfg.greedy:  # what a deployed team does (issue 32: every proof reports greedy beside T=1)
            res["greedy"] = evaluate_team(self.controller, self.store, self.eval_tasks, temperature=0.0,
                                          tag=f"{tag}-greedy")
        for kind, s in res.items():
            say(f"      team {s['success']:.1%}, scout {s['scout_success']:.1%}, closer {s['closer_success']:.1%} "
                f"({s['closer_success_after_good_scout']:.1%} after a good scout), "
                + ("sampled (T=1)" if kind == "sampled" else "greedy"))
        return res

    def report(self) -> dict[str, Any]:
        before, after = self.results["before"]["sampled"], self.results["after"]["sampled"]
        keys = ("success", "scout_success", "closer_success", "closer_success_after_good_scout")
        self.results["roles"] = {k: {"before": before[k], "after": after[k], "gain_pp": 100 * (after[k] - before[k])}
                                 for k in keys}
        res = super().report()
        for k in keys[1:]:
            r = self.results["roles"][k]
            say(f"  {k.replace('_', ' ')}: {r['before']:.1%} -> {r['after']:.1%} ({r['gain_pp']:+.1f} pp)")
        return res
