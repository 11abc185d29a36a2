"""Tool-using conversations driven by the real SDKs (anthropic, openai's Responses client), sync
and async, streamed and not, and the checks every translated rollout must pass: recorded as
trainable chat calls with the caller's request beside them, merged into one training row."""

from __future__ import annotations

from typing import Any

from lightning_middleware import LLMCall, TraceStore
from lightning_middleware.rows import build_rows_for_rollouts
from lightning_middleware.testing import render_chat, tokenize

QUESTION = "what is 2+2?"
SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
ANTHROPIC_TOOLS = [{"name": "calc", "description": "math", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "calc", "description": "math", "parameters": SCHEMA, "strict": False}]


def _next_anthropic(messages: list[Any], reply: Any) -> list[Any] | None:
    """The conversation after `reply`, with each tool_use answered; None once it stops calling."""
    uses = [b for b in reply.content if b.type == "tool_use"]
    if not uses:
        return None
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "4"} for b in uses]
    return [*messages, {"role": "assistant", "content": reply.content}, {"role": "user", "content": results}]


def anthropic_turns(client: Any, *, stream: bool) -> list[Any]:
    messages: list[Any] | None = [{"role": "user", "content": QUESTION}]
    replies = []
    while messages is not None and len(replies) < 4:
        kw = {"model": "m", "max_tokens": 300, "system": "be brief", "messages": messages, "tools": ANTHROPIC_TOOLS}
        if stream:
            with client.messages.stream(**kw) as s:
                kinds = [event.type for event in s]
                reply = s.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        else:
            reply = client.messages.create(**kw)
        replies.append(reply)
        messages = _next_anthropic(messages, reply)
    return replies


async def anthropic_turns_async(client: Any, *, stream: bool) -> list[Any]:
    messages: list[Any] | None = [{"role": "user", "content": QUESTION}]
    replies = []
    while messages is not None and len(replies) < 4:
        kw = {"model": "m", "max_tokens": 300, "system": "be brief", "messages": messages, "tools": ANTHROPIC_TOOLS}
        if stream:
            async with client.messages.stream(**kw) as s:
                kinds = [event.type async for event in s]
                reply = await s.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        else:
            reply = await client.messages.create(**kw)
        replies.append(reply)
        messages = _next_anthropic(messages, reply)
    return replies


def _next_responses(items: list[Any], response: Any) -> list[Any] | None:
    calls = [i for i in response.output if i.type == "function_call"]
    if not calls:
        return None
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "4"} for c in calls]
    return [*items, *(i.model_dump(exclude_none=True) for i in response.output), *outputs]


def responses_turns(client: Any, *, stream: bool) -> list[Any]:
    items: list[Any] | None = [{"role": "user", "content": QUESTION}]
    replies = []
    while items is not None and len(replies) < 4:
        kw = {"model": "m", "instructions": "be brief", "input": items, "tools": RESPONSES_TOOLS}
        if stream:
            with client.responses.stream(**kw) as s:
                kinds = [event.type for event in s]
                reply = s.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        else:
            reply = client.responses.create(**kw)
        replies.append(reply)
        items = _next_responses(items, reply)
    return replies


async def responses_turns_async(client: Any, *, stream: bool) -> list[Any]:
    items: list[Any] | None = [{"role": "user", "content": QUESTION}]
    replies = []
    while items is not None and len(replies) < 4:
        kw = {"model": "m", "instructions": "be brief", "input": items, "tools": RESPONSES_TOOLS}
        if stream:
            async with client.responses.stream(**kw) as s:
                kinds = [event.type async for event in s]
                reply = await s.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        else:
            reply = await client.responses.create(**kw)
        replies.append(reply)
        items = _next_responses(items, reply)
    return replies


def check_anthropic_replies(replies: list[Any]) -> None:
    first, second = replies
    assert first.stop_reason == "tool_use" and first.content[0].type == "tool_use"
    assert first.content[0].name == "calc" and first.content[0].input == {"query": QUESTION}
    assert second.stop_reason == "end_turn" and second.content[0].text == "echo: 4"
    assert second.usage.input_tokens > first.usage.input_tokens > 0


def check_responses_replies(replies: list[Any]) -> None:
    first, second = replies
    [call] = first.output
    assert call.type == "function_call" and call.name == "calc" and call.arguments == f'{{"query": "{QUESTION}"}}'
    assert second.output_text == "echo: 4" and second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens > 0


def check_training_rollout(store: TraceStore, rollout_id: str, source_format: str, *, turns: int = 2,
                           stream: bool | None = None) -> list[LLMCall]:
    """The rollout's calls are trainable chat calls whose token IDs are the engine's for the
    translated request, with the caller's own request kept, and its turns merge into one row."""
    store.flush()
    calls = store.calls(rollout_id)
    assert len(calls) == turns
    for c in calls:
        assert c.endpoint == "chat.completions" and c.is_training and c.source_format == source_format
        assert c.prompt_token_ids == tuple(tokenize(render_chat(c.request["messages"])))
        assert c.logprobs is not None and len(c.logprobs) == len(c.completion_token_ids) > 0
        assert c.source_request is not None and c.source_request["model"] == "m"
        assert c.id.isalnum() and (stream is None or c.stream == stream)
    rollout = store.get_rollout(rollout_id)
    assert rollout is not None
    rows, stats = build_rows_for_rollouts([(rollout, calls)])
    assert len(rows) == 1 and stats.prefix_breaks == 0
    assert sum(rows[0].loss_mask) == sum(len(c.completion_token_ids) for c in calls)
    assert rows[0].behaviour_logprobs is not None
    return calls
