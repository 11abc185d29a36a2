"""The demo's task, its tiny model and the warm-start (SFT) script.

Task: guess a secret number 1..15 in at most 4 guesses with a ``guess`` tool that
answers ``higher`` / ``lower`` / ``correct``; reward 1 if the number is found
within 4 guesses. Exact bisection (8, then 4/12, ...) always wins, so the task has
a clear optimum and a smooth path to it: a policy that picks the midpoint with
probability p per turn succeeds with roughly p^3..p^4.

The game rules, prompts and tool schema are plain Python: the agent process imports
them. The model, tokenizer and warm start are in warm_start.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

LOW, HIGH, MAX_GUESSES = 1, 15, 4
SYSTEM = "Find the secret number with the guess tool."
USER = f"I picked a number from {LOW} to {HIGH}. You have {MAX_GUESSES} guesses."
TOOL_NAME = "guess"
TOOL_DESCRIPTION = "Guess the number. Answers higher, lower or correct."

# The tool as LangChain's convert_to_openai_tool writes it for `def guess(n: int)`
# with the description above, and as vLLM hands it to the chat template (checked
# against the server's /tokenize by tests/test_demo.py).
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": TOOL_DESCRIPTION,
        "parameters": {"properties": {"n": {"type": "integer"}}, "required": ["n"], "type": "object"},
    },
}


# ------------------------------------------------------------------ the game

def answer(secret: int, n: Any) -> str:
    """What the guess tool says."""
    try:
        n = int(n)
    except (TypeError, ValueError):
        return "invalid"
    if n == secret:
        return "correct"
    return "higher" if secret > n else "lower"


def make_tasks(n: int, seed: int, prefix: str) -> list[dict[str, Any]]:
    """n tasks with secrets drawn uniformly from LOW..HIGH (a fixed seed, its own stream per prefix)."""
    rng = random.Random(f"{prefix}:{seed}")
    return [{"task_id": f"{prefix}-{i}", "secret": rng.randint(LOW, HIGH)} for i in range(n)]


def bisection_guesses(secret: int) -> list[int]:
    lo, hi, out = LOW, HIGH, []
    while True:
        g = (lo + hi) // 2
        out.append(g)
        if g == secret:
            return out
        lo, hi = (g + 1, hi) if secret > g else (lo, g - 1)


DEMO_TURNS = ("any", "found")


def demo_decision(secret: int, rng: random.Random, eps: float, turn: str = "any", habit: float = 0.0) -> list[int]:
    """One SFT demonstration: the exact-bisection guesses before a turn k, then the guess at
    turn k, which with probability eps is drawn uniformly from the range still consistent with
    the answers (else the midpoint). The SFT loss covers only that last guess, and every context
    is on the bisection tree: the warm-started policy knows the tree (without a habit, greedy is
    near-perfect where it tells the contexts apart) but at temperature 1 picks the midpoint only
    ~1-eps of the time.

    `turn`: "any" draws k uniformly along the secret's path, so over uniform secrets the first
    guess's context ends 36% of the demonstrations and each of the 8 last-guess contexts 1.7%;
    "found" takes the turn where bisection finds the secret, and since each of the tree's 15
    contexts is the one where exactly one secret is found, each gets 1/15.

    `habit`: with this probability a guess among three consistent numbers is the lowest, before
    the noise is drawn: a systematic error, which greedy decoding keeps where it outweighs the
    midpoint (habit above ~0.4 at eps 0.35). It costs a game one of the three secrets, so a
    policy that has it leaves RL something to fix at greedy, not only at temperature 1."""
    clean = bisection_guesses(secret)
    if turn not in DEMO_TURNS:
        raise ValueError(f"demonstration turn must be one of {', '.join(DEMO_TURNS)}, not {turn!r}")
    k = rng.randrange(len(clean)) if turn == "any" else len(clean) - 1
    lo, hi = LOW, HIGH
    for g in clean[:k]:
        lo, hi = (g + 1, hi) if secret > g else (lo, g - 1)
    if habit and hi - lo == 2 and rng.random() < habit:  # no draw at habit 0: the same demonstrations as before
        last = lo
    else:
        last = rng.randint(lo, hi) if rng.random() < eps else clean[k]
    return clean[:k] + [last]


def tool_call_text(n: int) -> str:
    """The assistant turn the hermes parser reads (what the chat template renders back)."""
    return f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {{"n": {n}}}}}\n</tool_call>'


def episode_messages(secret: int, guesses: Sequence[int]) -> list[dict[str, Any]]:
    """An episode in OpenAI message form (as the LangChain agent sends it)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    for i, g in enumerate(guesses):
        call_id = f"call_{i}"
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": TOOL_NAME, "arguments": json.dumps({"n": g})}}]})
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": answer(secret, g)})
    return msgs
