"""Anthropic Messages, translated to chat completions and back (docs/formats.md).

`system` becomes the first system message; each message's text blocks its content, an
assistant's `tool_use` blocks its tool calls (arguments: the input as JSON, as vLLM writes them),
a user's `tool_result` blocks tool messages in their order; `tools` with `input_schema` become
function tools, `max_tokens` and `stop_sequences` chat's `max_tokens` and `stop`, and a final
assistant message is continued (prefill: vLLM's `continue_final_message`). Images, documents,
thinking blocks and server tools are refused with a 400 naming the block. The answer's text and
tool calls become `text` and `tool_use` blocks, streamed as `message_start`,
`content_block_start`/`_delta`/`_stop`, `message_delta` and `message_stop`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson

from lightning_middleware.formats.common import (
    Format,
    History,
    StreamHandler,
    as_dict,
    as_list,
    as_str,
    first_message,
    invalid,
    sse,
    text_content,
    tool_calls_of,
    unsupported,
)

log = logging.getLogger(__name__)

NAME = "anthropic.messages"

# Request fields that shape no token of the answer (caching hints, routing, attribution): accepted, not sent.
_IGNORED = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics",
                      "user_profile_id", "workspace_id"})
_MAPPED = frozenset({"messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences", "stream",
                     "thinking", "container", "mcp_servers", "context_management", "output_config", "n"})
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
_ERROR_TYPES = {"server_error": "api_error", "upstream_error": "api_error", "upstream_timeout": "timeout_error",
                "store_unavailable": "overloaded_error"}


# --------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------

def to_chat(payload: dict[str, Any], history: History | None) -> dict[str, Any]:
    """The chat-completions request for a Messages request; raises TranslationError."""
    _refuse_features(payload)
    messages: list[dict[str, Any]] = []
    if payload.get("system") is not None:
        messages.append({"role": "system", "content": _system(payload["system"])})
    for i, message in enumerate(as_list(payload.get("messages"), "messages")):
        _message(as_dict(message, f"messages[{i}]"), f"messages[{i}]", messages)
    chat: dict[str, Any] = {k: v for k, v in payload.items() if k not in _MAPPED and k not in _IGNORED}
    chat["messages"] = messages
    if payload.get("max_tokens") is not None:
        chat["max_tokens"] = payload["max_tokens"]
    if payload.get("stop_sequences"):
        chat["stop"] = [as_str(s, f"stop_sequences[{i}]")
                        for i, s in enumerate(as_list(payload["stop_sequences"], "stop_sequences"))]
    if payload.get("tools"):
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(as_list(payload["tools"], "tools"))]
    if payload.get("tool_choice") is not None:
        _tool_choice(as_dict(payload["tool_choice"], "tool_choice"), chat)
    fmt = _response_format(payload.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        # A prefilled answer: the model continues it, and the answer holds only what it added.
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if payload.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the usage `message_delta` reports
    return chat


def _refuse_features(payload: dict[str, Any]) -> None:
    thinking = payload.get("thinking")
    if thinking is not None and as_dict(thinking, "thinking").get("type") != "disabled":
        raise unsupported("thinking", "extended thinking")
    for key, what in (("container", "a code-execution container"), ("mcp_servers", "remote MCP servers"),
                      ("context_management", "server-side context management")):
        if payload.get(key):
            raise unsupported(key, what)
    if payload.get("n") not in (None, 1):
        raise unsupported("n", "several choices")


def _system(system: Any) -> str | list[dict[str, str]] | None:
    if isinstance(system, str):
        return system
    return text_content(_texts(as_list(system, "system"), "system"))


def _texts(blocks: list[Any], field: str) -> list[str]:
    """The text of text blocks; any other block is refused."""
    return [_text_block(as_dict(b, f"{field}[{j}]"), f"{field}[{j}]") for j, b in enumerate(blocks)]


def _text_block(block: dict[str, Any], field: str) -> str:
    if block.get("type") != "text":
        raise _refused_block(block.get("type"), field)
    if block.get("citations"):
        raise unsupported(f"{field}.citations", "citations")
    return as_str(block.get("text"), f"{field}.text")


def _refused_block(kind: Any, field: str) -> Exception:
    if kind in ("image", "document", "search_result", "container_upload"):
        return unsupported(f"{field}.type", f"a {kind!r} block (only text is)")
    if isinstance(kind, str) and (kind.endswith("_tool_result") or kind in ("server_tool_use", "mcp_tool_use")):
        return unsupported(f"{field}.type", f"a {kind!r} block (a server-side tool)")
    return unsupported(f"{field}.type", f"a {kind!r} block")


def _message(message: dict[str, Any], field: str, out: list[dict[str, Any]]) -> None:
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise invalid(f"{field}.role", f"role {role!r} is not user or assistant")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
    elif role == "assistant":
        out.append(_assistant(as_list(content, f"{field}.content"), f"{field}.content"))
    else:
        _user(as_list(content, f"{field}.content"), f"{field}.content", out)


def _assistant(blocks: list[Any], field: str) -> dict[str, Any]:
    """One assistant turn: its text as the content, its tool_use blocks as the tool calls."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        f = f"{field}[{j}]"
        block = as_dict(block, f)
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, f))
        elif kind == "tool_use":
            # The separators vLLM's tool parsers write (`json.dumps` defaults): the call renders
            # into the next prompt as the engine produced it.
            arguments = json.dumps(as_dict(block.get("input", {}), f"{f}.input"), ensure_ascii=False)
            calls.append({"id": as_str(block.get("id"), f"{f}.id"), "type": "function",
                          "function": {"name": as_str(block.get("name"), f"{f}.name"), "arguments": arguments}})
        else:
            raise _refused_block(kind, f)
    out: dict[str, Any] = {"role": "assistant", "content": text_content(texts)}
    if calls:
        out["tool_calls"] = calls
    return out


def _user(blocks: list[Any], field: str, out: list[dict[str, Any]]) -> None:
    """A user turn: each tool_result a tool message, each run of text blocks a user message, in order."""
    texts: list[str] = []
    for j, block in enumerate(blocks):
        f = f"{field}[{j}]"
        block = as_dict(block, f)
        if block.get("type") == "tool_result":
            if texts:
                out.append({"role": "user", "content": text_content(texts)})
                texts = []
            out.append(_tool_result(block, f))
        else:
            texts.append(_text_block(block, f))
    if texts:
        out.append({"role": "user", "content": text_content(texts)})


def _tool_result(block: dict[str, Any], field: str) -> dict[str, Any]:
    content = block.get("content", "")
    if not isinstance(content, str):
        content = text_content(_texts(as_list(content, f"{field}.content"), f"{field}.content"))
    # `is_error` has no chat-completions field: the tool message carries the content only.
    return {"role": "tool", "tool_call_id": as_str(block.get("tool_use_id"), f"{field}.tool_use_id"),
            "content": "" if content is None else content}


def _tool(tool: Any, field: str) -> dict[str, Any]:
    tool = as_dict(tool, field)
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise unsupported(f"{field}.type", f"the {kind!r} tool (Anthropic-defined and server tools)")
    if tool.get("defer_loading"):
        raise unsupported(f"{field}.defer_loading", "deferred tool loading")
    fn: dict[str, Any] = {"name": as_str(tool.get("name"), f"{field}.name")}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    fn["parameters"] = as_dict(tool.get("input_schema"), f"{field}.input_schema")
    if tool.get("strict") is not None:
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": as_str(choice.get("name"),
                                                                               "tool_choice.name")}}
    else:
        raise unsupported("tool_choice.type", f"tool_choice {kind!r}")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _response_format(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    config = as_dict(config, "output_config")
    if config.get("effort") is not None:
        raise unsupported("output_config.effort", "effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    fmt = as_dict(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise unsupported("output_config.format.type", f"output format {fmt.get('type')!r}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema") or {}}}


# --------------------------------------------------------------------------
# The answer
# --------------------------------------------------------------------------

def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = orjson.loads(arguments) if arguments else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("a tool call's arguments are not a JSON object; the tool_use block gets {} (%.80s)", arguments)
        return {}
    return value


def _stop(finish_reason: Any, stop_reason: Any, source: dict[str, Any], tools: bool) -> tuple[str, str | None]:
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in (source.get("stop_sequences") or ()):
        return "stop_sequence", stop_reason
    if tools and finish_reason != "length":
        return "tool_use", None
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _usage(usage: Any, prompt_tokens: int = 0, completion_tokens: int = 0) -> dict[str, Any]:
    u = usage if isinstance(usage, dict) else {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": int(u.get("prompt_tokens") or prompt_tokens),
            "output_tokens": int(u.get("completion_tokens") or completion_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message_head(source: dict[str, Any], call_id: str, model: Any) -> dict[str, Any]:
    return {"id": f"msg_{call_id}", "type": "message", "role": "assistant", "model": source.get("model") or model,
            "content": [], "stop_reason": None, "stop_sequence": None}


def answer(chat: dict[str, Any], source: dict[str, Any], call_id: str) -> dict[str, Any]:
    """The Messages answer for the engine's chat-completions answer."""
    choice, message = first_message(chat)
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text, "citations": None})
    calls = tool_calls_of(message)
    for tool_id, name, arguments in calls:
        content.append({"type": "tool_use", "id": tool_id, "name": name, "input": _tool_input(arguments)})
    reason, sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), source, bool(calls))
    out = _message_head(source, call_id, chat.get("model"))
    out.update(content=content, stop_reason=reason, stop_sequence=sequence, usage=_usage(chat.get("usage")))
    return out


class AnthropicStream(StreamHandler):
    """The Messages event stream for a chat-completions stream, event for event: a content block
    opens at its first text or tool-call delta and stops when the next opens or the choice
    finishes; `message_delta` (stop reason, usage) and `message_stop` follow the usage."""

    def __init__(self, source: dict[str, Any], call_id: str) -> None:
        super().__init__()
        self.source, self.call_id = source, call_id
        self.index = -1  # the open content block's index
        self.open: tuple[str, int] | None = None  # ("text", 0) or ("tool", chat tool-call index)
        self.tools = False
        self.reason: str | None = None
        self.stop_reason: Any = None
        self.usage_: Any = None
        self.prompt_tokens = self.completion_tokens = 0
        self.held = ""  # the open tool block's leading whitespace, until its arguments show their kind
        self.args_object: bool | None = None  # whether they open a JSON object (None: not known yet)

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        data["type"] = kind
        self.out.append(sse(kind, data))

    def start(self, chunk: dict[str, Any]) -> None:
        self.prompt_tokens = len(chunk.get("prompt_token_ids") or ())
        message = _message_head(self.source, self.call_id, chunk.get("model"))
        message["usage"] = _usage(None, self.prompt_tokens, 0)
        self.emit("message_start", {"message": message})

    def _block(self, key: tuple[str, int], block: dict[str, Any]) -> None:
        self._stop_block()
        self.index += 1
        self.open = key
        self.emit("content_block_start", {"index": self.index, "content_block": block})

    def text(self, delta: str) -> None:
        if self.open != ("text", 0):
            self._block(("text", 0), {"type": "text", "text": "", "citations": None})
        self.emit("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": delta}})

    def tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        if self.open != ("tool", index):
            self.tools = True
            self._block(("tool", index), {"type": "tool_use", "id": call_id or "", "name": name or "", "input": {}})
            self.held, self.args_object = "", None
        if not arguments or self.args_object is False:
            return
        if self.args_object is None:
            # A tool_use input is an object: the SDK parses the deltas into one. Arguments that do
            # not open one (a small model's `42`) are not passed on, so the block keeps its `{}`
            # as the whole answer would (`_tool_input`).
            self.held += arguments
            head = self.held.lstrip()
            if not head:
                return
            self.args_object = head.startswith("{")
            if not self.args_object:
                log.warning("a streamed tool call's arguments are not a JSON object; the tool_use block gets {}")
                return
            arguments, self.held = self.held, ""
        self.emit("content_block_delta", {"index": self.index,
                                          "delta": {"type": "input_json_delta", "partial_json": arguments}})

    def tokens(self, n: int) -> None:
        self.completion_tokens += n

    def usage(self, usage: dict[str, Any]) -> None:
        self.usage_ = usage

    def finish(self, reason: str, stop_reason: Any) -> None:
        self.reason, self.stop_reason = reason, stop_reason
        self._stop_block()

    def _stop_block(self) -> None:
        if self.open is not None:
            self.emit("content_block_stop", {"index": self.index})
            self.open = None

    def close(self) -> None:
        if self.reason is None:  # the engine's stream was cut: so is the caller's (recorded as partial)
            return
        reason, sequence = _stop(self.reason, self.stop_reason, self.source, self.tools)
        usage = _usage(self.usage_, self.prompt_tokens, self.completion_tokens)
        self.emit("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"input_tokens": usage["input_tokens"],
                                              "output_tokens": usage["output_tokens"]}})
        self.emit("message_stop", {})

    def fail(self, message: str) -> None:
        self.emit("error", {"error": {"type": "api_error", "message": message}})


def error(status: int, message: str, kind: str, field: str | None) -> dict[str, Any]:
    """An Anthropic-style error body (the SDK reads `error.message`)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(kind, kind), "message": message}}


FORMAT = Format(name=NAME, route="messages", suffix="/v1/messages",
                vendor_hosts=frozenset({"api.anthropic.com"}), to_chat=to_chat,
                answer=answer, stream_handler=AnthropicStream, error=error)
