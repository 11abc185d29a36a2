"""What the reward tests share: a tool-using agent on the test LLM, a judge that is a real
OpenAI-compatible HTTP server on loopback, and stored calls built as records."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx2
import openai

from lightning_middleware import TraceStore, wrap
from lightning_middleware.records import LLMCall
from lightning_middleware.testing import TEST_BASE_URL, llm_http_client

TOOLS = [{"type": "function", "function": {"name": "run_python", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}]


def client_for(store: TraceStore) -> openai.OpenAI:
    return wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="x", http_client=llm_http_client(httpx2)), store=store)


def tool_agent(client: openai.OpenAI, question: str, tool_result: str) -> str:
    """Two turns on the test LLM: it calls run_python, gets `tool_result`, then answers."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": tool_result}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    return str(second.choices[0].message.content)


def tool_call(index: int, name: str, arguments: Any, *, offered: tuple[str, ...] = ("run_python",),
              content: str | None = None, results: tuple[str, ...] = ()) -> LLMCall:
    """A stored chat call whose reply calls `name` (arguments: a dict, or raw text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the bug"}]
    messages += [{"role": "tool", "tool_call_id": f"c{index - 1}-{i}", "content": r} for i, r in enumerate(results)]
    tools = [{"type": "function", "function": {"name": n}} for n in offered]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if name:
        message["tool_calls"] = [{"id": f"c{index}-0", "type": "function", "function": {"name": name,
                                                                                     "arguments": args}}]
    return LLMCall(id=f"call-{index}", rollout_id="r", call_index=index, status_code=200,
                   request={"messages": messages, "tools": tools},
                   response={"choices": [{"index": 0, "message": message}]}, started_at=float(index))


class _Judge(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        if self.path.startswith("/down/"):
            self.send_response(503)
            self.end_headers()
            return
        text = body["messages"][-1]["content"]
        solved = "echo:" in text and "Error" not in text
        reply = "Score: 8. Solved." if solved else "Score: 2. Not solved."
        if self.path.startswith("/vague/"):
            reply = "It is fine."
        out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *_args: Any) -> None:
        pass


@contextmanager
def judge_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A judge on 127.0.0.1: "Score: 8" when the final answer echoes and no error shows, else 2;
    under /down/ it answers 503, under /vague/ with no number. Yields (base URL, bodies seen)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.seen  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
