"""The OpenAI Responses API, translated to chat completions and back (docs/formats.md).

A request's `instructions` become the first system message, `input` items the messages after
the conversation `previous_response_id` names (read back from the trace store): messages by
role, `function_call` items the tool calls of the assistant message before them (the engine
produced them in one message, so they go back as one, and the prompt renders as it did), and
`function_call_output` items tool messages. Function tools map one to one. What chat completions
cannot express (images, files, hosted tools, reasoning items, stored prompts) is refused with a
400 naming the field. The answer's message text and tool calls become `message` and
`function_call` output items, streamed as the Responses event types.
"""

from __future__ import annotations

from typing import Any

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

NAME = "responses"

# Request fields that shape no token of the answer (bookkeeping of the hosted API): accepted, not sent.
_IGNORED = frozenset({"store", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                      "service_tier", "stream_options", "user"})
# Translated below (not passed on as they are).
_MAPPED = frozenset({"input", "instructions", "previous_response_id", "tools", "tool_choice", "max_output_tokens",
                     "text", "stream", "reasoning", "include", "truncation", "background", "conversation", "prompt",
                     "max_tool_calls", "top_logprobs", "n"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


# --------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------

def to_chat(payload: dict[str, Any], history: History | None) -> dict[str, Any]:
    """The chat-completions request for a Responses request; raises TranslationError."""
    _refuse_features(payload)
    messages: list[dict[str, Any]] = []
    if payload.get("instructions") is not None:
        messages.append({"role": "system", "content": as_str(payload["instructions"], "instructions")})
    previous = payload.get("previous_response_id")
    if previous is not None:
        if history is None:
            raise unsupported("previous_response_id", "previous_response_id without a trace store")
        messages.extend(history(as_str(previous, "previous_response_id")))
    messages.extend(_input_messages(payload.get("input")))
    chat: dict[str, Any] = {k: v for k, v in payload.items() if k not in _MAPPED and k not in _IGNORED}
    chat["messages"] = messages
    if payload.get("tools"):
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(as_list(payload["tools"], "tools"))]
    if payload.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(payload["tool_choice"])
    if payload.get("max_output_tokens") is not None:
        chat["max_tokens"] = payload["max_output_tokens"]
    text = as_dict(payload.get("text") or {}, "text")
    fmt = _response_format(text.get("format"))
    if fmt is not None:
        chat["response_format"] = fmt
    # Chat completions' own names for these knobs; vLLM renders reasoning_effort into the prompt
    # (templates that take it) and ignores verbosity, saying so in its log.
    if text.get("verbosity") is not None:
        chat["verbosity"] = text["verbosity"]
    effort = (payload.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if payload.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the usage `response.completed` reports
    return chat


def _refuse_features(payload: dict[str, Any]) -> None:
    """Hosted-API features with no chat-completions equivalent."""
    for key, what in (("conversation", "a stored conversation"), ("prompt", "a stored prompt template"),
                      ("max_tool_calls", "max_tool_calls"), ("top_logprobs", "top_logprobs")):
        if payload.get(key) is not None:
            raise unsupported(key, what)
    if payload.get("background"):
        raise unsupported("background", "a background response")
    if payload.get("include"):
        raise unsupported("include", f"include {payload['include']!r}")
    if payload.get("truncation") not in (None, "disabled"):
        raise unsupported("truncation", f"truncation {payload['truncation']!r}")
    reasoning = payload.get("reasoning")
    for key, value in as_dict(reasoning or {}, "reasoning").items():
        if key != "effort" and value is not None:  # summaries of reasoning the answer does not return
            raise unsupported(f"reasoning.{key}", f"reasoning.{key}")
    if payload.get("n") not in (None, 1):
        raise unsupported("n", "several choices")


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(as_list(value, "input")):
        field = f"input[{i}]"
        item = as_dict(item, field)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, field))
        elif kind == "function_call":
            _function_call(item, field, out)
        elif kind == "function_call_output":
            out.append(_function_output(item, field))
        elif kind == "reasoning":
            raise unsupported(f"{field}.type", "a reasoning item")
        elif kind == "item_reference":
            raise unsupported(f"{field}.type", "an item_reference")
        else:
            raise unsupported(f"{field}.type", f"an input item of type {kind!r} (a hosted tool's item)")
    return out


def _message(item: dict[str, Any], field: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise invalid(f"{field}.role", f"role {role!r} is not one of user, system, developer, assistant")
    # The hosted API treats developer messages as system ones; chat templates know only system.
    return {"role": "system" if role == "developer" else role,
            "content": _text(item.get("content"), f"{field}.content")}


def _text(content: Any, field: str) -> str | list[dict[str, str]] | None:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(as_list(content, field)):
        part = as_dict(part, f"{field}[{j}]")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append(as_str(part.get("text"), f"{field}[{j}].text"))
        elif kind == "refusal":
            raise unsupported(f"{field}[{j}].type", "a refusal part")
        else:
            raise unsupported(f"{field}[{j}].type", f"a {kind!r} content part (only text is)")
    return text_content(parts)


def _function_call(item: dict[str, Any], field: str, out: list[dict[str, Any]]) -> None:
    call = {"id": as_str(item.get("call_id"), f"{field}.call_id"), "type": "function",
            "function": {"name": as_str(item.get("name"), f"{field}.name"),
                         "arguments": as_str(item.get("arguments", ""), f"{field}.arguments")}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":  # the message the engine wrote it in
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_output(item: dict[str, Any], field: str) -> dict[str, Any]:
    output = item.get("output", "")
    content = output if isinstance(output, str) else _text(output, f"{field}.output")
    return {"role": "tool", "tool_call_id": as_str(item.get("call_id"), f"{field}.call_id"),
            "content": "" if content is None else content}


def _tool(tool: Any, field: str) -> dict[str, Any]:
    tool = as_dict(tool, field)
    kind = tool.get("type")
    if kind != "function":
        raise unsupported(f"{field}.type", f"the {kind!r} tool (hosted tools run on the vendor's servers)")
    fn: dict[str, Any] = {"name": as_str(tool.get("name"), f"{field}.name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": as_str(choice.get("name"), "tool_choice.name")}}
    raise unsupported("tool_choice", f"tool_choice {choice!r}")


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None or as_dict(fmt, "text.format").get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise unsupported("text.format.type", f"text format {fmt.get('type')!r}")


# --------------------------------------------------------------------------
# The answer
# --------------------------------------------------------------------------

def _message_item(call_id: str, index: int, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{call_id}_{index}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _function_item(call_id: str, index: int, tool_id: str, name: str, arguments: str, status: str
                   ) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id}_{index}", "call_id": tool_id, "name": name,
            "arguments": arguments, "status": status}


def _status(finish_reason: Any) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _usage(usage: Any, prompt_tokens: int = 0, completion_tokens: int = 0) -> dict[str, Any]:
    u = usage if isinstance(usage, dict) else {}
    p = int(u.get("prompt_tokens") or prompt_tokens)
    c = int(u.get("completion_tokens") or completion_tokens)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def _envelope(source: dict[str, Any], call_id: str, created: Any, model: Any, status: str) -> dict[str, Any]:
    """The response object around the output: the request's settings echoed, as the API does."""
    return {
        "id": f"resp_{call_id}", "object": "response", "created_at": created, "status": status,
        "background": False, "error": None, "incomplete_details": None,
        "instructions": source.get("instructions"), "max_output_tokens": source.get("max_output_tokens"),
        "model": source.get("model") or model, "output": [],
        "parallel_tool_calls": source.get("parallel_tool_calls", True),
        "previous_response_id": source.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
        "store": source.get("store", True), "temperature": source.get("temperature"),
        "text": source.get("text") or {"format": {"type": "text"}}, "tool_choice": source.get("tool_choice", "auto"),
        "tools": source.get("tools") or [], "top_p": source.get("top_p"), "truncation": "disabled",
        "usage": None, "metadata": source.get("metadata") or {}, "user": source.get("user"),
    }


def answer(chat: dict[str, Any], source: dict[str, Any], call_id: str) -> dict[str, Any]:
    """The Responses answer for the engine's chat-completions answer."""
    choice, message = first_message(chat)
    status, incomplete = _status(choice.get("finish_reason"))
    item_status = "completed" if incomplete is None else "incomplete"
    output: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(_message_item(call_id, 0, text, item_status))
    for tool_id, name, arguments in tool_calls_of(message):
        output.append(_function_item(call_id, len(output), tool_id, name, arguments, item_status))
    out = _envelope(source, call_id, chat.get("created"), chat.get("model"), status)
    out.update(output=output, incomplete_details=incomplete, usage=_usage(chat.get("usage")))
    return out


class ResponsesStream(StreamHandler):
    """The Responses event stream for a chat-completions stream, event for event: an output item
    opens when its first text or tool-call delta arrives and closes when the next one opens or
    the choice finishes; `response.completed` follows once the usage has arrived."""

    def __init__(self, source: dict[str, Any], call_id: str) -> None:
        super().__init__()
        self.source, self.call_id = source, call_id
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed output items
        self.item: dict[str, Any] | None = None  # the open one
        self.tool_index = -1  # the chat tool-call index of the open function_call item
        self.parts: list[str] = []  # the open item's text or arguments so far
        self.reason: str | None = None
        self.usage_: Any = None
        self.prompt_tokens = self.completion_tokens = 0
        self.envelope: dict[str, Any] = {}

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        data["type"], data["sequence_number"] = kind, self.seq
        self.seq += 1
        self.out.append(sse(kind, data))

    def start(self, chunk: dict[str, Any]) -> None:
        self.prompt_tokens = len(chunk.get("prompt_token_ids") or ())
        self.envelope = _envelope(self.source, self.call_id, chunk.get("created"), chunk.get("model"), "in_progress")
        self.emit("response.created", {"response": self.envelope})
        self.emit("response.in_progress", {"response": self.envelope})

    def _open(self, item: dict[str, Any]) -> None:
        self.item, self.parts = item, []
        self.emit("response.output_item.added", {"output_index": len(self.items), "item": item})

    def text(self, delta: str) -> None:
        if self.item is None or self.item["type"] != "message":
            self._close_item()
            item = _message_item(self.call_id, len(self.items), "", "in_progress")
            part = item.pop("content")[0]
            self._open({**item, "content": []})
            self.emit("response.content_part.added", {"item_id": item["id"], "output_index": len(self.items),
                                                      "content_index": 0, "part": part})
        self.parts.append(delta)
        self.emit("response.output_text.delta", {"item_id": self.item["id"], "output_index": len(self.items),  # type: ignore[index]
                                                 "content_index": 0, "delta": delta, "logprobs": []})

    def tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        if self.item is None or self.item["type"] != "function_call" or index != self.tool_index:
            self._close_item()
            self.tool_index = index
            self._open(_function_item(self.call_id, len(self.items), call_id or "", name or "", "", "in_progress"))
        elif name:
            self.item["name"] += name
        if arguments:
            self.parts.append(arguments)
            self.emit("response.function_call_arguments.delta",
                      {"item_id": self.item["id"], "output_index": len(self.items), "delta": arguments})  # type: ignore[index]

    def tokens(self, n: int) -> None:
        self.completion_tokens += n

    def usage(self, usage: dict[str, Any]) -> None:
        self.usage_ = usage

    def finish(self, reason: str, stop_reason: Any) -> None:
        self.reason = reason
        self._close_item()

    def _close_item(self) -> None:
        item = self.item
        if item is None:
            return
        index, whole = len(self.items), "".join(self.parts)
        item["status"] = "incomplete" if self.reason == "length" else "completed"
        if item["type"] == "message":
            part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
            self.emit("response.output_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                                    "text": whole, "logprobs": []})
            self.emit("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                     "content_index": 0, "part": part})
            item["content"] = [part]
        else:
            item["arguments"] = whole
            self.emit("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                "name": item["name"], "arguments": whole})
        self.emit("response.output_item.done", {"output_index": index, "item": item})
        self.items.append(item)
        self.item = None

    def close(self) -> None:
        if self.reason is None:  # the engine's stream was cut: so is the caller's (recorded as partial)
            return
        status, incomplete = _status(self.reason)
        final = {**self.envelope, "status": status, "incomplete_details": incomplete, "output": self.items,
                 "usage": _usage(self.usage_, self.prompt_tokens, self.completion_tokens)}
        self.emit("response.completed" if incomplete is None else "response.incomplete", {"response": final})

    def fail(self, message: str) -> None:
        self._close_item()
        final = {**self.envelope, "status": "failed", "output": self.items,
                 "error": {"code": "server_error", "message": message}}
        self.emit("response.failed", {"response": final})


def error(status: int, message: str, kind: str, field: str | None) -> dict[str, Any]:
    """An OpenAI-style error body; `param` names the field a refused request was refused for."""
    return {"error": {"message": message, "type": kind, "param": field, "code": None}}


FORMAT = Format(name=NAME, route="responses", suffix="/responses",
                vendor_hosts=frozenset({"api.openai.com"}), to_chat=to_chat,
                answer=answer, stream_handler=ResponsesStream, error=error)
