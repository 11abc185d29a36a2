"""Golden translations of the Responses API: every input item and content part that is translated,
every one that is refused (with the field named), and the answer whole and streamed."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_middleware import LLMCall
from lightning_middleware.formats import FORMATS, TranslationError
from lightning_middleware.formats.history import conversation_of
from lightning_middleware.formats.responses import answer, to_chat
from tests.formats.streams import CALL_ID, TOOL_CALLS, chat_answer, chat_chunks, events, feed_bytewise

SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
CALL_1 = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"query": "2+2"}'}}
CALL_2 = {"id": "call_2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
CALL_3 = {"id": "call_3", "type": "function", "function": {"name": "calc", "arguments": "{}"}}

REQUEST: dict[str, Any] = {
    "model": "m", "instructions": "be brief",
    "input": [
        {"role": "developer", "content": "answer in digits"},
        {"role": "user", "content": [{"type": "input_text", "text": "what is"},
                                     {"type": "input_text", "text": "2+2?"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "let me check", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calc", "arguments": '{"query": "2+2"}',
         "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "calc", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "none"}]},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "now answer"}]},
        {"type": "function_call", "call_id": "call_3", "name": "calc", "arguments": "{}"},
    ],
    "tools": [{"type": "function", "name": "calc", "description": "math", "parameters": SCHEMA, "strict": True}],
    "tool_choice": {"type": "function", "name": "calc"}, "parallel_tool_calls": False,
    "max_output_tokens": 50, "temperature": 0.5, "top_p": 0.9,
    "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}},
    "store": True, "metadata": {"k": "v"}, "user": "u1", "include": [], "reasoning": {"effort": None, "summary": None},
    "truncation": "disabled", "stream": True, "top_k": 20,  # top_k: a vLLM extension, passed on as it is
}
CHAT: dict[str, Any] = {
    "model": "m", "parallel_tool_calls": False, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "answer in digits"},
        {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "let me check", "tool_calls": [CALL_1, CALL_2]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "tool", "tool_call_id": "call_2", "content": "none"},
        {"role": "system", "content": "now answer"},
        {"role": "assistant", "content": None, "tool_calls": [CALL_3]},
    ],
    "tools": [{"type": "function", "function": {"name": "calc", "description": "math", "parameters": SCHEMA,
                                                "strict": True}}],
    "tool_choice": {"type": "function", "function": {"name": "calc"}}, "max_tokens": 50,
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    "stream": True, "stream_options": {"include_usage": True},
}


def test_every_supported_item_and_part() -> None:
    assert to_chat(REQUEST, None) == CHAT


@pytest.mark.parametrize(("given", "chat"), [
    ({"input": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}),
    ({"input": "hi", "tool_choice": "required", "text": {"format": {"type": "text"}}},
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}},
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}),
    # The Agents SDK's default model settings: chat completions has both knobs under these names.
    ({"input": "hi", "reasoning": {"effort": "none"}, "text": {"verbosity": "low"}},
     {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none", "verbosity": "low"}),
    ({"input": [{"type": "message", "role": "user", "content": []}]},
     {"messages": [{"role": "user", "content": None}]}),
])
def test_small_requests(given: dict[str, Any], chat: dict[str, Any]) -> None:
    assert to_chat({"model": "m", **given}, None) == {"model": "m", **chat}


def test_previous_response_id_continues_that_conversation() -> None:
    earlier = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    asked: list[str] = []

    def history(response_id: str) -> list[dict[str, Any]]:
        asked.append(response_id)
        return earlier

    chat = to_chat({"model": "m", "instructions": "new rules", "previous_response_id": "resp_x", "input": "3+3?"},
                   history)
    assert asked == ["resp_x"]
    assert chat["messages"] == [{"role": "system", "content": "new rules"}, *earlier,
                                {"role": "user", "content": "3+3?"}]


REFUSED = [  # (request fields, the field the 400 names)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_file", "file_id": "f"}]}]}, "input[0].content[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    *(({"input": [{"role": "user", "content": "x"}, {"type": kind, "id": "x"}]}, "input[1].type")
      for kind in ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                   "image_generation_call", "code_interpreter_call", "local_shell_call", "mcp_call",
                   "mcp_list_tools", "custom_tool_call")),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[0].output[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].output[0].type"),
    *(({"input": [{"type": kind, "id": "x"}]}, "input[0].type")
      for kind in ("local_shell_call_output", "mcp_approval_request", "mcp_approval_response",
                   "custom_tool_call_output", "web_search_call_output")),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    *(({"input": "x", "tools": [{"type": kind}]}, "tools[0].type")
      for kind in ("web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
                   "mcp", "image_generation", "local_shell", "custom")),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"input": "x", "reasoning": {"effort": "high", "summary": "auto"}}, "reasoning.summary"),
    ({"input": "x", "reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "max_tool_calls": 3}, "max_tool_calls"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),  # no store to read it from
]


@pytest.mark.parametrize(("given", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_what_cannot_be_translated_is_refused_naming_the_field(given: dict[str, Any], field: str) -> None:
    with pytest.raises(TranslationError) as caught:
        to_chat({"model": "m", **given}, None)
    assert caught.value.field == field and caught.value.status == 400
    assert str(caught.value).startswith(field + ":")


EXPECTED_OUTPUT = [
    {"type": "message", "id": f"msg_{CALL_ID}_0", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "let me check", "annotations": [], "logprobs": []}]},
    {"type": "function_call", "id": f"fc_{CALL_ID}_1", "call_id": "call_a", "name": "calc",
     "arguments": '{"query": "2+2"}', "status": "completed"},
    {"type": "function_call", "id": f"fc_{CALL_ID}_2", "call_id": "call_b", "name": "lookup", "arguments": "{}",
     "status": "completed"},
]
USAGE = {"input_tokens": 31, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 12,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 43}
SOURCE = {"model": "m", "input": "2+2?", "instructions": "be brief", "temperature": 0.5,
          "tools": REQUEST["tools"], "metadata": {"k": "v"}}


def test_the_answer() -> None:
    out = answer(chat_answer(tool_calls=TOOL_CALLS), SOURCE, CALL_ID)
    assert out["output"] == EXPECTED_OUTPUT and out["usage"] == USAGE
    assert (out["id"], out["object"], out["status"], out["incomplete_details"]) == (f"resp_{CALL_ID}", "response",
                                                                                    "completed", None)
    assert (out["model"], out["instructions"], out["temperature"], out["tools"], out["metadata"]) == (
        "m", "be brief", 0.5, REQUEST["tools"], {"k": "v"})  # the request's settings echoed, as the API does
    assert "token_ids" not in str(out) and "logprobs': {" not in str(out)


def test_a_cut_answer_is_incomplete() -> None:
    out = answer(chat_answer(content="12", finish="length"), SOURCE, CALL_ID)
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in out["output"]] == ["message"] and out["output"][0]["status"] == "incomplete"


def test_the_stream_event_by_event() -> None:
    rewriter = FORMATS["responses"].stream_rewriter(SOURCE, CALL_ID)
    given, tail = feed_bytewise(rewriter, chat_chunks())
    # Each chat chunk is translated when it is whole, not at the end: the first one opens the response.
    assert [e for e, _ in events(given[0])] == ["response.created", "response.in_progress"]
    assert [e for e, _ in events(given[1])] == ["response.output_item.added", "response.content_part.added",
                                                "response.output_text.delta"]
    assert [e for e, _ in events(given[2])] == ["response.output_text.delta"]
    assert tail == b""
    evs = events(b"".join(given))
    assert [e for e, _ in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert "".join(d["delta"] for e, d in evs if e == "response.output_text.delta") == "let me check"
    done = evs[-1][1]["response"]
    assert done["output"] == EXPECTED_OUTPUT and done["usage"] == USAGE and done["status"] == "completed"
    whole = answer(chat_answer(tool_calls=TOOL_CALLS), SOURCE, CALL_ID)
    assert {k: v for k, v in done.items() if k != "created_at"} == {k: v for k, v in whole.items()
                                                                    if k != "created_at"}


def test_a_stream_cut_before_its_end_has_no_completed_event() -> None:
    rewriter = FORMATS["responses"].stream_rewriter(SOURCE, CALL_ID)
    given, tail = feed_bytewise(rewriter, chat_chunks(tools=False)[:3])
    assert "response.completed" not in [e for e, _ in events(b"".join(given) + tail)]


def test_an_error_mid_stream_fails_the_response() -> None:
    rewriter = FORMATS["responses"].stream_rewriter(SOURCE, CALL_ID)
    chunks = chat_chunks(tools=False)[:2] + [b'data: {"error": {"message": "engine died", "type": "x"}}\n\n']
    given, tail = feed_bytewise(rewriter, chunks)
    name, data = events(b"".join(given) + tail)[-1]
    assert name == "response.failed" and data["response"]["error"]["message"] == "engine died"


def test_errors_are_openai_shaped_with_the_field() -> None:
    fmt = FORMATS["responses"]
    assert fmt.error_body(400, b'{"error": {"message": "too long", "type": "BadRequestError"}}') == (
        b'{"error":{"message":"too long","type":"BadRequestError","param":null,"code":null}}')
    refused = fmt.refusal_body(TranslationError("tools[0].type", "no"))
    assert b'"param":"tools[0].type"' in refused


def _previous(**fields: Any) -> LLMCall:
    """A recorded translated Responses call: `instructions` + a user message, answered with text
    and a tool call."""
    reply = {"role": "assistant", "content": "let me check", "tool_calls": TOOL_CALLS[:1]}
    base: dict[str, Any] = {
        "id": CALL_ID, "rollout_id": "r", "call_index": 0, "status_code": 200, "source_format": "responses",
        "source_request": {"model": "m", "instructions": "be brief", "input": "2+2?"},
        "request": {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "2+2?"}]},
        "response": {"choices": [{"index": 0, "message": reply, "finish_reason": "tool_calls"}]}}
    return LLMCall(**{**base, **fields})


def test_previous_response_is_the_conversation_without_its_instructions() -> None:
    assert conversation_of(_previous(), f"resp_{CALL_ID}") == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "let me check", "tool_calls": TOOL_CALLS[:1]}]


@pytest.mark.parametrize("call", [
    None,  # not in the store
    _previous(source_format=None),  # a chat call: no Responses answer has that id
    _previous(source_format="anthropic.messages"),
    _previous(status_code=500, response=None),  # failed
    _previous(partial=True),  # a stream cut before its end
], ids=["missing", "chat", "anthropic", "failed", "partial"])
def test_a_previous_response_that_cannot_be_continued_is_a_400(call: LLMCall | None) -> None:
    with pytest.raises(TranslationError) as caught:
        conversation_of(call, "resp_x")
    assert caught.value.field == "previous_response_id" and caught.value.status == 400
    assert caught.value.code == "previous_response_not_found"
