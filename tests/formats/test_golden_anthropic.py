"""Golden translations of Anthropic Messages: every content block and field that is translated,
every one that is refused (with the field named), and the answer whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lightning_middleware.formats import FORMATS, TranslationError
from lightning_middleware.formats.anthropic import answer, to_chat
from tests.formats.streams import CALL_ID, TOOL_CALLS, chat_answer, chat_chunks, events, feed_bytewise

SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}}
CACHE = {"type": "ephemeral"}

REQUEST: dict[str, Any] = {
    "model": "m", "max_tokens": 100,
    "system": [{"type": "text", "text": "be brief", "cache_control": CACHE}, {"type": "text", "text": "use tools"}],
    "messages": [
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "let me check"},
            {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"query": "2+2", "é": [1, 2]}},
            {"type": "tool_use", "id": "toolu_2", "name": "calc", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4", "cache_control": CACHE},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "input"}]},
            {"type": "text", "text": "thanks"}, {"type": "text", "text": "and 3+3?", "citations": None}]},
        {"role": "assistant", "content": "The answer is"},  # a prefill: the model continues it
    ],
    "tools": [{"name": "calc", "description": "math", "input_schema": SCHEMA, "cache_control": CACHE},
              {"type": "custom", "name": "note", "input_schema": {"type": "object"}, "strict": True}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\n", "END"], "temperature": 0.2, "top_p": 0.9, "top_k": 5,
    "metadata": {"user_id": "u"}, "service_tier": "auto", "thinking": {"type": "disabled"}, "stream": True,
}
CHAT: dict[str, Any] = {
    "model": "m", "max_tokens": 100, "temperature": 0.2, "top_p": 0.9, "top_k": 5,
    "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "use tools"}]},
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": "let me check", "tool_calls": [
            # json.dumps defaults, as vLLM's tool parsers write arguments: the call renders as generated
            {"id": "toolu_1", "type": "function", "function": {"name": "calc",
                                                              "arguments": '{"query": "2+2", "é": [1, 2]}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "4"},
        {"role": "tool", "tool_call_id": "toolu_2",
         "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "input"}]},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}, {"type": "text", "text": "and 3+3?"}]},
        {"role": "assistant", "content": "The answer is"},
    ],
    "tools": [{"type": "function", "function": {"name": "calc", "description": "math", "parameters": SCHEMA}},
              {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}, "strict": True}}],
    "tool_choice": "required", "parallel_tool_calls": False, "stop": ["\n\n", "END"],
    "continue_final_message": True, "add_generation_prompt": False,
    "stream": True, "stream_options": {"include_usage": True},
}


def test_every_supported_block_and_field() -> None:
    assert to_chat(REQUEST, None) == CHAT


@pytest.mark.parametrize(("given", "chat"), [
    ({"system": "be brief", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
      "tool_choice": {"type": "auto"}},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
      "tool_choice": "auto"}),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool", "name": "calc"}},
     {"messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "function", "function": {"name": "calc"}}}),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "none"}},
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none"}),
    ({"messages": [{"role": "user", "content": "hi"}],
      "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
     {"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}}),
    # tool_use without a result yet, last: not a prefill, the engine answers a new turn
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
])
def test_small_requests(given: dict[str, Any], chat: dict[str, Any]) -> None:
    assert to_chat({"model": "m", **given}, None) == {"model": "m", **chat}


def _user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


def _assistant(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": list(blocks)}]}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
REFUSED = [  # (request fields, the field the 400 names)
    (_user(IMAGE), "messages[0].content[0].type"),
    (_user({"type": "text", "text": "a"}, {"type": "document", "source": {}}), "messages[0].content[1].type"),
    (_user({"type": "search_result", "source": "s", "title": "t", "content": []}), "messages[0].content[0].type"),
    (_user({"type": "container_upload", "file_id": "f"}), "messages[0].content[0].type"),
    (_user({"type": "text", "text": "a", "citations": [{"type": "char_location"}]}),
     "messages[0].content[0].citations"),
    (_user({"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}), "messages[0].content[0].content[0].type"),
    *((_user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "a"}, {"type": kind}]}),
       "messages[0].content[0].content[1].type") for kind in ("document", "search_result", "tool_reference")),
    ({"messages": [], "thinking": {"type": "adaptive"}}, "thinking"),
    (_assistant({"type": "thinking", "thinking": "hm", "signature": "s"}), "messages[1].content[0].type"),
    (_assistant({"type": "redacted_thinking", "data": "x"}), "messages[1].content[0].type"),
    *((_assistant({"type": "text", "text": "a"}, {"type": kind, "id": "s"}), "messages[1].content[1].type")
      for kind in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                   "mcp_tool_use", "mcp_tool_result")),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"system": [IMAGE], "messages": []}, "system[0].type"),
    *(({"messages": [], "tools": [{"type": kind, "name": "t"}]}, "tools[0].type")
      for kind in ("web_search_20250305", "web_fetch_20250910", "bash_20250124", "text_editor_20250728",
                   "computer_20250124", "code_execution_20250825", "memory_20250818",
                   "tool_search_tool_regex_20251119")),
    ({"messages": [], "tools": [{"name": "t", "input_schema": SCHEMA, "defer_loading": True}]},
     "tools[0].defer_loading"),
    ({"messages": [], "tools": [{"name": "t"}]}, "tools[0].input_schema"),
    ({"messages": [], "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [], "container": "c1"}, "container"),
    ({"messages": [], "mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, "mcp_servers"),
    ({"messages": [], "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management"),
    ({"messages": [], "output_config": {"effort": "high"}}, "output_config.effort"),
    ({"messages": [], "output_config": {"format": {"type": "grammar"}}}, "output_config.format.type"),
    ({"messages": [], "tool_choice": {"type": "weird"}}, "tool_choice.type"),
    ({"messages": [], "n": 2}, "n"),
    ({"messages": "hi"}, "messages"),
]


@pytest.mark.parametrize(("given", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_what_cannot_be_translated_is_refused_naming_the_field(given: dict[str, Any], field: str) -> None:
    with pytest.raises(TranslationError) as caught:
        to_chat({"model": "m", "max_tokens": 10, **given}, None)
    assert caught.value.field == field and caught.value.status == 400
    assert str(caught.value).startswith(field + ":")


SOURCE = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "2+2?"}],
          "stop_sequences": ["END"]}
CONTENT = [{"type": "text", "text": "let me check", "citations": None},
           {"type": "tool_use", "id": "call_a", "name": "calc", "input": {"query": "2+2"}},
           {"type": "tool_use", "id": "call_b", "name": "lookup", "input": {}}]
USAGE = {"input_tokens": 31, "output_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 8}


def test_the_answer() -> None:
    assert answer(chat_answer(tool_calls=TOOL_CALLS), SOURCE, CALL_ID) == {
        "id": f"msg_{CALL_ID}", "type": "message", "role": "assistant", "model": "m", "content": CONTENT,
        "stop_reason": "tool_use", "stop_sequence": None, "usage": USAGE}


@pytest.mark.parametrize(("finish", "stop_reason", "expected"), [
    ("stop", None, ("end_turn", None)), ("length", None, ("max_tokens", None)),
    ("stop", "END", ("stop_sequence", "END")),  # vLLM names the stop string that ended the answer
    ("stop", 151645, ("end_turn", None)),  # ... or the stop token's id
])
def test_stop_reasons(finish: str, stop_reason: Any, expected: tuple[str, str | None]) -> None:
    out = answer(chat_answer(content="4", finish=finish, stop_reason=stop_reason), SOURCE, CALL_ID)
    assert (out["stop_reason"], out["stop_sequence"]) == expected and out["content"][0]["text"] == "4"


def test_the_stream_event_by_event() -> None:
    rewriter = FORMATS["messages"].stream_rewriter(SOURCE, CALL_ID)
    given, tail = feed_bytewise(rewriter, chat_chunks())
    first = events(given[0])
    assert [e for e, _ in first] == ["message_start"]
    assert first[0][1]["message"]["usage"]["input_tokens"] == 31  # from the first chunk's prompt token IDs
    assert [e for e, _ in events(given[1])] == ["content_block_start", "content_block_delta"]
    assert tail == b""
    evs = events(b"".join(given))
    assert [e for e, _ in evs] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    starts = [d["content_block"] for e, d in evs if e == "content_block_start"]
    assert starts == [{"type": "text", "text": "", "citations": None},
                      {"type": "tool_use", "id": "call_a", "name": "calc", "input": {}},
                      {"type": "tool_use", "id": "call_b", "name": "lookup", "input": {}}]
    json_parts = [d["delta"]["partial_json"] for e, d in evs if e == "content_block_delta" and d["index"] == 1]
    assert "".join(json_parts) == '{"query": "2+2"}'
    assert evs[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                          "usage": {"input_tokens": 31, "output_tokens": 12}}


def test_a_stream_cut_before_its_end_has_no_message_stop() -> None:
    rewriter = FORMATS["messages"].stream_rewriter(SOURCE, CALL_ID)
    given, tail = feed_bytewise(rewriter, chat_chunks(tools=False)[:3])
    assert "message_stop" not in [e for e, _ in events(b"".join(given) + tail)]


def test_without_a_usage_chunk_the_stream_counts_tokens_itself() -> None:
    rewriter = FORMATS["messages"].stream_rewriter(SOURCE, CALL_ID)
    given, tail = feed_bytewise(rewriter, chat_chunks(tools=False, finish="stop", usage=False, done=False))
    name, data = events(b"".join(given) + tail)[-2]  # [DONE] never came: the end of the body closes it
    assert name == "message_delta" and data["usage"] == {"input_tokens": 31, "output_tokens": 4}


def test_an_error_mid_stream_is_an_error_event() -> None:
    rewriter = FORMATS["messages"].stream_rewriter(SOURCE, CALL_ID)
    chunks = chat_chunks(tools=False)[:2] + [b'data: {"error": {"message": "engine died", "type": "x"}}\n\n']
    given, tail = feed_bytewise(rewriter, chunks)
    assert events(b"".join(given) + tail)[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                                                       "message": "engine died"}})


def test_errors_are_anthropic_shaped() -> None:
    fmt = FORMATS["messages"]
    assert fmt.error_body(400, b'{"error": {"message": "too long", "type": "BadRequestError"}}') == (
        b'{"type":"error","error":{"type":"BadRequestError","message":"too long"}}')
    assert fmt.error_body(500, b"oops") == b'{"type":"error","error":{"type":"api_error","message":"oops"}}'


def _tool_chunks(*pieces: str) -> list[bytes]:
    """A stream whose one tool call's arguments arrive in `pieces`."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "served"}
    deltas = [{"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "calc", "arguments": ""}}]}]
    deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in pieces]
    chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


@pytest.mark.parametrize(("pieces", "partial_json"), [
    (("\n", " {\"q", "\": 1}"), ["\n {\"q", "\": 1}"]),  # leading whitespace is held until the object opens
    (("  ", "42"), []),  # not an object (a small model's number): the block keeps its {} ...
    (("Infin", "ity"), []),
])
def test_streamed_tool_arguments_reach_the_sdk_only_as_an_object(pieces: tuple[str, ...],
                                                                  partial_json: list[str]) -> None:
    rewriter = FORMATS["messages"].stream_rewriter(SOURCE, CALL_ID)
    evs = events(b"".join(rewriter.feed(c) for c in _tool_chunks(*pieces)) + rewriter.finish())
    assert [d["delta"]["partial_json"] for e, d in evs if e == "content_block_delta"] == partial_json
    assert [e for e, _ in evs][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    whole = answer(chat_answer(content=None, tool_calls=[{"id": "call_a", "type": "function", "function": {
        "name": "calc", "arguments": "".join(pieces)}}]), SOURCE, CALL_ID)
    assert whole["content"][0]["input"] == ({"q": 1} if partial_json else {})  # ... as the whole answer's does
