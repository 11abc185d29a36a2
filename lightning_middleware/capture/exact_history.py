"""Earlier assistant turns sent back to the engine as the text the model sampled.

A framework sends a tool-calling turn back as a structured `tool_calls` entry (what the server's
tool parser made of the sampled text); the chat template renders it back in its canonical form.
When the model sampled anything else (the guess demo's policy learned to drop the unrewarded
"\\n" before `</tool_call>`), the next prompt no longer starts with the previous prompt and
completion: the model is asked to continue a history it did not write, and training splits the
rollout into one row per turn (a prefix break, docs/demo.md).

With `wrap(..., exact_history=True)` each tool-calling answer of a rollout is remembered with its
sampled text (its logprob tokens joined, `Assembled.sampled_text`), and a later request of the
same rollout that carries that turn back, by its tool call IDs, sends it as an assistant message
whose content is that text. ChatML-style templates (hermes tools: Qwen, SmolLM2, the demos')
render such a message as exactly the sampled tokens, so turns merge into one row. Templates that
render tool calls in a header of their own (Llama 3.1's ipython role, Mistral's checks of tool
call IDs) would read it differently: the option is off by default, and the trainer's parity check
(`--serve`) and per-step `prefix_breaks` measure what it does on a given model.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class SampledTurns:
    """A rollout's tool-calling answers: their tool call IDs -> the text the model sampled."""

    def __init__(self) -> None:
        self._by_ids: dict[tuple[str, ...], str] = {}
        self._lock = threading.Lock()

    def remember(self, response: dict[str, Any] | None, text: str | None) -> None:
        """Keep choice 0 of a chat answer, if it called tools and its sampled text is known."""
        if text is None or not isinstance(response, dict):
            return
        ids = _call_ids(_first_message(response))
        if ids:
            with self._lock:
                self._by_ids[ids] = text

    def restore(self, messages: Sequence[Any]) -> list[Any] | None:
        """`messages` with each remembered turn as its sampled text; None if none was remembered."""
        with self._lock:
            if not self._by_ids:
                return None
            known = dict(self._by_ids)
        out: list[Any] = []
        changed = False
        for m in messages:
            text = known.get(_call_ids(m)) if isinstance(m, dict) and m.get("role") == "assistant" else None
            if text is None:
                out.append(m)
                continue
            out.append({"role": "assistant", "content": text})
            changed = True
        return out if changed else None


def _first_message(response: dict[str, Any]) -> Any:
    choices = response.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first.get("message") if isinstance(first, dict) else None


def _call_ids(message: Any) -> tuple[str, ...]:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list) or not calls:
        return ()
    ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
    return tuple(str(i) for i in ids) if all(isinstance(i, str) and i for i in ids) else ()
