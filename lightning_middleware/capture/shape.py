"""What an answer must look like before capture reads tokens out of it.

A server can answer anything (a proxy's HTML error page with 200, JSON of another API, a stream
cut mid-event, token IDs that are strings). Capture checks the shape first and reads only what
passed: a problem becomes the call's `error` (so it is never trained on) instead of an exception
on the store's writer thread, where it would cost the whole record. The checks are exactly what
`assembly` goes on to read, no more: fields it ignores may hold anything, and logprobs are read
leniently (a malformed block costs the call its logprobs, not its record).
"""

from __future__ import annotations

from typing import Any

INT32 = 2**31  # token IDs are stored as 32-bit integers


def token_ids_problem(value: Any, what: str) -> str | None:
    """None if `value` is absent or a list of 32-bit integers (the store's packing)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
            type(t) is int and -INT32 <= t < INT32 for t in value):  # bool is an int, not a token ID
        return f"{what} are not a list of 32-bit integers"
    return None


def _typed(value: Any, *types: type) -> bool:
    return value is None or (isinstance(value, types) and not isinstance(value, bool))


def choice_problem(choice: Any, endpoint: str, *, streamed: bool) -> str | None:
    """A choice of a whole answer, or of one stream chunk."""
    if not isinstance(choice, dict):
        return "a choice is not an object"
    if not _typed(choice.get("index"), int) or not _typed(choice.get("finish_reason"), str):
        return "a choice's index is not an integer or its finish_reason not a string"
    problem = (token_ids_problem(choice.get("token_ids"), "token_ids")
               or token_ids_problem(choice.get("prompt_token_ids"), "prompt_token_ids"))
    if problem or endpoint == "responses":
        return problem
    if endpoint == "completions":
        return None if _typed(choice.get("text"), str) else "a choice's text is not a string"
    return delta_problem(choice.get("delta")) if streamed else message_problem(choice.get("message"))


def message_problem(message: Any) -> str | None:
    return None if isinstance(message, dict) else "a chat choice has no message object"


def delta_problem(delta: Any) -> str | None:
    if delta is None:
        return None
    if not isinstance(delta, dict):
        return "a delta is not an object"
    if not all(_typed(delta.get(k), str) for k in ("role", "content", "reasoning_content", "reasoning")):
        return "a delta's role or content is not a string"
    calls = delta.get("tool_calls")
    if not _typed(calls, list) or any(tool_call_problem(tc) for tc in calls or ()):
        return "a delta's tool_calls are not a list of tool call objects"
    return None


def tool_call_problem(tc: Any) -> str | None:
    if not isinstance(tc, dict) or not _typed(tc.get("index"), int):
        return "a tool call is not an object with an integer index"
    fn = tc.get("function")
    if not all(_typed(tc.get(k), str) for k in ("id", "type")) or not _typed(fn, dict):
        return "a tool call's id, type or function is malformed"
    if not all(_typed((fn or {}).get(k), str) for k in ("name", "arguments")):
        return "a tool call's name or arguments are not strings"
    return None


def body_problem(body: dict[str, Any], endpoint: str) -> str | None:
    """What makes a whole (non-streamed) answer no `endpoint` answer, or None. Only choice 0 (the
    record's columns) is checked here: a broken other choice costs only itself (`choice_problem`)."""
    if endpoint == "responses":
        return None  # recorded as it came, never trained on
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        return "the answer has no choices"
    return (token_ids_problem(body.get("prompt_token_ids"), "prompt_token_ids")
            or choice_problem(choices[0], endpoint, streamed=False))


def chunk_problem(chunk: dict[str, Any]) -> str | None:
    """What makes one stream chunk as a whole unreadable, or None (its choices are checked one by
    one: a usage chunk has none)."""
    if not _typed(chunk.get("choices"), list):
        return "a chunk's choices are not a list"
    return token_ids_problem(chunk.get("prompt_token_ids"), "prompt_token_ids")
