"""The deterministic "model" behind the test LLM server and the in-process test transport.

It answers like vLLM does (`prompt_token_ids`, per-choice `token_ids`, logprobs,
SSE streaming with token-ID deltas) but its "model" is a script, so tests can
predict every token:

- Tokens are the UTF-8 bytes of a ChatML rendering (ids 0..255), so a later
  turn's prompt starts with the earlier prompt + completion, exactly as a real
  chat template behaves: multi-turn rows merge.
- If the request offers tools and no tool result came since the last user
  message, the reply calls the first tool (hermes `<tool_call>` text, parsed
  into `tool_calls`). With a model name containing `multi-tool` it calls every
  offered tool, one per turn, in order. Then it answers `echo: <last message>`.
  With a model name containing `loose-format` it samples its calls with a "\n" before
  `</tool_call>`, which the rendering of a structured call back leaves out (the format
  drift of a policy that learned an unrewarded variant: capture/exact_history.py).
- Logprob of completion token i is `-(i % 7) / 10`.
- `n` > 1: `n` distinct choices. Choice 0 is the answer above; choice k answers `echo k: ...`
  (a tool call gets `"variant": k` in its arguments), and its token i has logprob
  `-((i + k) % 7) / 10`. Streamed, the choices' chunks take turns.
- Test hooks, as request headers: `x-test-fail-times: N` fails the first N
  attempts of an identical body with 500; `x-test-delay: S` sleeps S seconds
  before each streamed chunk; `x-test-strict: 1` rejects unknown fields with
  400, as the real OpenAI API would reject `return_token_ids`; `x-test-hang: S`
  waits S seconds before answering at all (an engine that stalls);
  `x-test-close-after: N` sends the first N SSE events of a stream, then drops
  the connection without finishing the body (an engine that dies mid-stream);
  `x-test-hold: KEY` sends a stream's first event, then holds the rest until a
  POST to `/test/release` with `{"key": KEY}` (a call that stays in flight for
  exactly as long as a test needs, on any machine's speed); `x-test-tag: TAG`
  counts the request under TAG as it arrives, read back with GET
  `/test/seen/TAG` (a test waits until its call is at the engine, not a guess
  at how long that takes).
  The last four are served by the HTTP server (`llm_server`) only.

`reply(path, headers, raw)` is the whole server as one function: the ASGI app
(`llm_server.build_app`) and the in-process transport (`transport.LLMTestTransport`)
both serve it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_fail_counts: Counter[str] = Counter()  # per request body: x-test-fail-times
_KNOWN_FIELDS = {
    "model", "messages", "prompt", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "stream",
    "stream_options", "n", "seed", "stop", "max_completion_tokens", "user", "parallel_tool_calls",
    "response_format", "input", "frequency_penalty", "presence_penalty",
}


def render_chat(messages: list[dict[str, Any]]) -> str:
    """ChatML, with assistant tool calls as hermes text and tool results as <tool_response>."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        text = content or ""
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function", {})
            text += _tool_call_text(fn.get("name", ""), fn.get("arguments", "{}"))
        if m.get("role") == "tool":
            text = f"<tool_response>{text}</tool_response>"
        out.append(f"<|im_start|>{m.get('role', 'user')}\n{text}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


def _tool_call_text(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _reply(body: dict[str, Any], k: int = 0) -> tuple[str, dict[str, Any] | None]:
    """(completion text, tool call or None) of choice `k` of a chat request."""
    messages = body.get("messages") or []
    tools = body.get("tools") or []
    since_user = []
    for m in reversed(messages):
        if m.get("role") == "user":
            break
        since_user.append(m)
    results = sum(1 for m in since_user if m.get("role") == "tool")
    # Default: call the first tool once. A model named "*multi-tool*": call every tool, in order.
    wanted = len(tools) if "multi-tool" in str(body.get("model", "")) else min(1, len(tools))
    if results < wanted:
        fn = tools[results].get("function", tools[results])
        query: dict[str, Any] = {"query": _last_text(messages)[:40]}
        args = json.dumps(query if k == 0 else {**query, "variant": k})
        call: dict[str, Any] = {"id": f"call_{hashlib.sha1(args.encode()).hexdigest()[:8]}", "type": "function",
                "function": {"name": fn.get("name", "tool"), "arguments": args}}
        text = _tool_call_text(call["function"]["name"], args)
        if "loose-format" in str(body.get("model", "")):
            text = text.replace("</tool_call>", "\n</tool_call>")
        return text, call
    return f"{_echo(k)} {_last_text(messages)[:60]}", None


def _echo(k: int) -> str:
    """The answer's opening word: choice k > 0 of a request with n > 1 answers differently."""
    return "echo:" if k == 0 else f"echo {k}:"


def _n_of(body: dict[str, Any]) -> int:
    try:
        return max(1, min(int(body.get("n") or 1), 64))
    except (TypeError, ValueError):
        return 1


def _last_text(messages: list[dict[str, Any]]) -> str:
    if not messages:
        return ""
    content = messages[-1].get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _cap(ids: list[int], body: dict[str, Any]) -> tuple[list[int], str]:
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    if limit is not None and len(ids) > int(limit):
        return ids[: int(limit)], "length"
    return ids, "stop"


def _logprob(i: int, k: int = 0) -> float:
    return -((i + k) % 7) / 10


def _logprobs_block(ids: list[int], start: int, chat: bool, k: int = 0) -> dict[str, Any]:
    if chat:
        return {"content": [{"token": f"<{t}>", "logprob": _logprob(start + i, k), "bytes": [t], "top_logprobs": []}
                            for i, t in enumerate(ids)]}
    return {"tokens": [f"<{t}>" for t in ids], "token_logprobs": [_logprob(start + i, k) for i in range(len(ids))],
            "top_logprobs": None, "text_offset": list(range(len(ids)))}


def _chat_choice(body: dict[str, Any], k: int) -> tuple[dict[str, Any], list[int]]:
    text, call = _reply(body, k)
    ids, finish = _cap(tokenize(text), body)
    if call is not None and finish == "stop":
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": bytes(ids).decode("utf-8", "replace")}
    choice: dict[str, Any] = {"index": k, "message": message, "finish_reason": finish, "logprobs": None}
    if body.get("logprobs"):
        choice["logprobs"] = _logprobs_block(ids, 0, True, k)
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
    return choice, ids


def _chat_response(body: dict[str, Any]) -> dict[str, Any]:
    prompt = tokenize(render_chat(body.get("messages") or []))
    choices, ids = zip(*(_chat_choice(body, k) for k in range(_n_of(body))))
    completion_tokens = sum(len(i) for i in ids)
    out: dict[str, Any] = {
        "id": "chatcmpl-" + hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12],
        "object": "chat.completion", "created": int(time.time()), "model": body.get("model", "test-model"),
        "choices": list(choices),
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt) + completion_tokens},
    }
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = prompt
    return out


def _completion_choice(body: dict[str, Any], prompt_ids: list[int], k: int) -> tuple[dict[str, Any], list[int]]:
    ids, finish = _cap(tokenize(f"{_echo(k)} {bytes(prompt_ids[-20:]).decode('utf-8', 'replace')}"), body)
    choice: dict[str, Any] = {"index": k, "text": bytes(ids).decode("utf-8", "replace"), "finish_reason": finish,
                              "logprobs": _logprobs_block(ids, 0, False, k) if body.get("logprobs") is not None
                              else None}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = ids
    return choice, ids


def _completion_response(body: dict[str, Any]) -> dict[str, Any]:
    prompt_text = body.get("prompt") or ""
    if isinstance(prompt_text, list):
        token_list = bool(prompt_text) and isinstance(prompt_text[0], int)
        prompt_ids = list(prompt_text) if token_list else tokenize(str(prompt_text[0]))
    else:
        prompt_ids = tokenize(prompt_text)
    choices, ids = zip(*(_completion_choice(body, prompt_ids, k) for k in range(_n_of(body))))
    completion_tokens = sum(len(i) for i in ids)
    return {"id": "cmpl-test", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model", "test-model"), "choices": list(choices),
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens}}


def _choice_deltas(body: dict[str, Any], choice: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """One choice of the full answer as its stream deltas, 4 tokens each, vLLM-style."""
    k, ids = choice["index"], choice["token_ids"]
    tool_calls = chat and choice["message"].get("tool_calls")
    out: list[dict[str, Any]] = []
    for start in range(0, max(len(ids), 1), 4):
        part = ids[start:start + 4]
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if start == 0 else {}
            if not tool_calls:
                delta["content"] = bytes(part).decode("utf-8", "replace")
            c: dict[str, Any] = {"index": k, "delta": delta, "finish_reason": None, "logprobs": None}
        else:
            c = {"index": k, "text": bytes(part).decode("utf-8", "replace"), "finish_reason": None, "logprobs": None}
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            c["logprobs"] = _logprobs_block(part, start, chat, k)
        if body.get("return_token_ids"):
            c["token_ids"] = part
            if start == 0 and not chat:
                c["prompt_token_ids"] = choice["prompt_token_ids"]
        out.append(c)
    if tool_calls:
        tc = tool_calls[0]
        out.append({"index": k, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "id": tc["id"], "type": "function",
             "function": {"name": tc["function"]["name"], "arguments": ""}}]}})
        out.append({"index": k, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": tc["function"]["arguments"]}}]}})
    out.append({"index": k, "delta": {}, "text": "", "finish_reason": choice["finish_reason"]})
    return out


def _stream_chunks(body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """The full response cut into SSE chunks of 4 tokens, vLLM-style: one choice a chunk, the
    choices of a request with n > 1 taking turns, so a reader must assemble them by `index`."""
    # Build the whole answer with token IDs on, then drop them per chunk if not asked for.
    full_body = {**body, "return_token_ids": True}
    full = _chat_response(full_body) if chat else _completion_response(full_body)
    head = {"id": full["id"], "created": full["created"], "model": full["model"],
            "object": "chat.completion.chunk" if chat else "text_completion"}
    per_choice = [_choice_deltas(body, choice, chat) for choice in full["choices"]]
    chunks = [{**head, "choices": [deltas[step]]}
              for step in range(max(len(d) for d in per_choice)) for deltas in per_choice if step < len(deltas)]
    if chat and body.get("return_token_ids"):
        chunks[0]["prompt_token_ids"] = full["prompt_token_ids"]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": full["usage"]})
    return chunks


def _responses_response(body: dict[str, Any]) -> dict[str, Any]:
    text = f"echo: {str(body.get('input'))[:60]}"
    return {"id": "resp_test", "object": "response", "created_at": int(time.time()), "status": "completed",
            "model": body.get("model", "test-model"),
            "output": [{"type": "message", "id": "msg_test", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10}}


@dataclass(frozen=True)
class ScriptedReply:
    """What the server answers: a JSON body, or SSE events sent `delay_s` apart."""

    status: int
    body: dict[str, Any] | None = None
    events: tuple[bytes, ...] = ()
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    hang_s: float = 0.0  # before answering (x-test-hang)
    close_after: int | None = None  # events sent before the connection drops (x-test-close-after)
    hold: str | None = None  # after the first event, wait for /test/release of this key (x-test-hold)

    @property
    def stream(self) -> bool:
        return bool(self.events)

    def json_bytes(self) -> bytes:
        return json.dumps(self.body).encode()


def _error(status: int, message: str, kind: str = "invalid_request_error") -> ScriptedReply:
    return ScriptedReply(status, {"error": {"message": message, "type": kind}})


_NUMBER = (int, float)
# The JSON types each request field takes (null, too: every field is optional), as vLLM's request
# validation checks them: a field of another type is a 400 there, so it is one here, not a crash.
REQUEST_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,), "messages": (list,), "prompt": (str, list), "max_tokens": (int,),
    "max_completion_tokens": (int,), "temperature": _NUMBER, "top_p": _NUMBER, "n": (int,), "stream": (bool,),
    "stream_options": (dict,), "stop": (str, list), "tools": (list,), "tool_choice": (str, dict), "seed": (int,),
    "return_token_ids": (bool,), "user": (str,), "response_format": (dict,), "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER, "parallel_tool_calls": (bool,), "top_logprobs": (int,),
}
_CHAT_ONLY = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                        "response_format", "top_logprobs"})


def request_fields(chat: bool) -> dict[str, tuple[type, ...]]:
    """The fields an endpoint reads and their types (another endpoint's fields are ignored there, as
    vLLM ignores unknown fields); `logprobs` is a flag in chat, a count in legacy completions."""
    skip = {"prompt"} if chat else _CHAT_ONLY
    fields = {k: v for k, v in REQUEST_FIELDS.items() if k not in skip}
    fields["logprobs"] = (bool,) if chat else (int,)
    return fields


def _typed(value: Any, types: tuple[type, ...]) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):  # JSON true/false are not numbers
        return bool in types
    return isinstance(value, types)


def request_problem(body: dict[str, Any], chat: bool) -> str | None:
    """What is wrong with a request's shape (None: nothing), as far as this server reads it."""
    fields = request_fields(chat)
    for name, value in body.items():
        types = fields.get(name)
        if types is not None and not _typed(value, types):
            return f"{name} must be of type {'/'.join(t.__name__ for t in types)}"
    if not chat:
        return _prompt_problem(body.get("prompt"))
    for i, m in enumerate(body.get("messages") or ()):
        problem = _message_problem(m)
        if problem:
            return f"messages[{i}]: {problem}"
    for tool in body.get("tools") or ():
        if not isinstance(tool, dict) or not isinstance(tool.get("function", {}), dict):
            return "tools must be objects with a function object"
    return None


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, list) and not (prompt and (isinstance(prompt[0], str) or _token_ids(prompt))):
        return "prompt must be a string, a list of strings, or token IDs in the vocabulary (0..255)"
    return None


def _message_problem(m: Any) -> str | None:
    if not isinstance(m, dict):
        return "a message must be an object"
    if not _typed(m.get("role"), (str,)) or not _typed(m.get("content"), (str, list)):
        return "role must be a string, content a string or a list of parts"
    content = m.get("content")
    parts: list[Any] = content if isinstance(content, list) else []
    if any(isinstance(p, dict) and not _typed(p.get("text"), (str,)) for p in parts):
        return "a content part's text must be a string"
    calls = m.get("tool_calls")
    if not _typed(calls, (list,)) or any(not isinstance(tc, dict) or not isinstance(tc.get("function", {}), dict)
                                        for tc in calls or ()):
        return "tool_calls must be a list of objects with a function object"
    return None


def _token_ids(prompt: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 256 for t in prompt)


def _header_number(headers: Mapping[str, str], name: str) -> float:
    """A test hook's number; an unreadable one is no hook (a fuzzed header must not crash the server)."""
    try:
        value = float(headers.get(name, "0"))
    except ValueError:
        return 0.0
    return value if 0 <= value < 1e6 else 0.0


def reply(path: str, headers: Mapping[str, str], raw: bytes) -> ScriptedReply:
    """The answer to a POST of `raw` to a completions route (`headers` with lower-case names)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return _error(400, "invalid JSON")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    chat = path.endswith("/chat/completions")
    problem = None if path.endswith("/responses") else request_problem(body, chat)
    if problem:
        return _error(400, problem)  # as vLLM's request validation answers
    if headers.get("x-test-strict") and set(body) - _KNOWN_FIELDS:
        return _error(400, f"unknown fields {sorted(set(body) - _KNOWN_FIELDS)}")
    fail_times = int(_header_number(headers, "x-test-fail-times"))
    if fail_times:
        key = hashlib.sha256(raw).hexdigest()
        if _fail_counts[key] < fail_times:
            _fail_counts[key] += 1
            return _error(500, "injected failure", "server_error")
    seen = {"x-test-received-headers": ",".join(sorted(headers.keys()))}
    hang_s = _header_number(headers, "x-test-hang")
    if path.endswith("/responses"):
        return ScriptedReply(200, _responses_response(body), headers=seen, hang_s=hang_s)
    if not body.get("stream"):
        return ScriptedReply(200, _chat_response(body) if chat else _completion_response(body), headers=seen,
                             hang_s=hang_s)
    events = tuple(f"data: {json.dumps(c)}\n\n".encode() for c in _stream_chunks(body, chat))
    close_after = int(_header_number(headers, "x-test-close-after")) if "x-test-close-after" in headers else None
    return ScriptedReply(200, events=events + (b"data: [DONE]\n\n",), headers=seen,
                         delay_s=_header_number(headers, "x-test-delay"), hang_s=hang_s, close_after=close_after,
                         hold=headers.get("x-test-hold"))


def tokenize_reply(raw: bytes) -> dict[str, Any]:
    """The answer of `/tokenize` (vLLM's shape) for a chat or completion request."""
    body = json.loads(raw)
    text = render_chat(body["messages"]) if "messages" in body else body.get("prompt", "")
    ids = tokenize(text)
    return {"tokens": ids, "count": len(ids), "max_model_len": 4096}


MODELS = {"object": "list", "data": [{"id": "test-model", "object": "model", "owned_by": "test"}]}
