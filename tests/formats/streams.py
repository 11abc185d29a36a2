"""Crafted chat-completions answers (whole and as vLLM's SSE chunks) and an SSE reader, for the
golden translation tests of both formats."""

from __future__ import annotations

import json
from typing import Any

CALL_ID = "0123456789abcdef0123456789abcdef"
TOOL_CALLS = [
    {"id": "call_a", "type": "function", "function": {"name": "calc", "arguments": '{"query": "2+2"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
]
USAGE = {"prompt_tokens": 31, "completion_tokens": 12, "total_tokens": 43,
         "prompt_tokens_details": {"cached_tokens": 8}}


def chat_answer(content: str | None = "let me check", tool_calls: list[dict[str, Any]] | None = None,
                finish: str = "tool_calls", **choice: Any) -> dict[str, Any]:
    """A whole chat-completions answer as vLLM sends it (token IDs and logprobs included)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "served",
            "prompt_token_ids": list(range(31)),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": [1, 2, 3],
                         "logprobs": {"content": []}, **choice}],
            "usage": USAGE}


def chat_chunks(*, text: tuple[str, ...] = ("let ", "me ", "check"), tools: bool = True, finish: str = "tool_calls",
                usage: bool = True, done: bool = True) -> list[bytes]:
    """The same answer as vLLM streams it: role, text deltas, each tool call opened then its
    arguments in two pieces, the finish, the usage chunk, [DONE]."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "served"}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"content": t} for t in text]
    if tools:
        for i, tc in enumerate(TOOL_CALLS):
            args = tc["function"]["arguments"]
            deltas.append({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                           "function": {"name": tc["function"]["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": args[:3]}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": args[3:]}}]})
    chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None, "token_ids": [7]}]} for d in deltas]
    chunks[0]["prompt_token_ids"] = list(range(31))
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish, "token_ids": []}]})
    if usage:
        chunks.append({**head, "choices": [], "usage": USAGE})
    out = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks]
    return out + [b"data: [DONE]\n\n"] if done else out


def events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event; checks the name repeats the data's type."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        body = json.loads(lines["data"])
        assert body["type"] == lines["event"], block
        out.append((lines["event"], body))
    return out


def feed_bytewise(rewriter: Any, chunks: list[bytes]) -> tuple[list[bytes], bytes]:
    """Feed a rewriter one byte at a time (the worst framing a socket can give): what it gave
    back after each whole upstream chunk, and its tail."""
    given = []
    for chunk in chunks:
        got = b"".join(rewriter.feed(chunk[i:i + 1]) for i in range(len(chunk)))
        given.append(got)
    return given, rewriter.finish()
