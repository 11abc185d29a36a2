"""A small deterministic OpenAI-compatible server for tests, examples and benchmarks.

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
- Logprob of completion token i is `-(i % 7) / 10`.
- Test hooks, as request headers: `x-test-fail-times: N` fails the first N
  attempts of an identical body with 500; `x-test-delay: S` sleeps S seconds
  before each streamed chunk; `x-test-strict: 1` rejects unknown fields with
  400, as the real OpenAI API would reject `return_token_ids`.

Run it with `python -m lightning_middleware.testing --port 8011`, or use
`LLMTestServer` (a subprocess) from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Any

_fail_counts: Counter[str] = Counter()
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


def _reply(body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(completion text, tool call or None) for a chat request."""
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
        args = json.dumps({"query": _last_text(messages)[:40]})
        call = {"id": f"call_{hashlib.sha1(args.encode()).hexdigest()[:8]}", "type": "function",
                "function": {"name": fn.get("name", "tool"), "arguments": args}}
        return _tool_call_text(call["function"]["name"], args), call
    return f"echo: {_last_text(messages)[:60]}", None


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


def _logprob(i: int) -> float:
    return -(i % 7) / 10


def _logprobs_block(ids: list[int], start: int, chat: bool) -> dict[str, Any]:
    if chat:
        return {"content": [{"token": f"<{t}>", "logprob": _logprob(start + i), "bytes": [t], "top_logprobs": []}
                            for i, t in enumerate(ids)]}
    return {"tokens": [f"<{t}>" for t in ids], "token_logprobs": [_logprob(start + i) for i in range(len(ids))],
            "top_logprobs": None, "text_offset": list(range(len(ids)))}


def _chat_response(body: dict[str, Any]) -> dict[str, Any]:
    prompt = tokenize(render_chat(body.get("messages") or []))
    text, call = _reply(body)
    ids, finish = _cap(tokenize(text), body)
    if call is not None and finish == "stop":
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": bytes(ids).decode("utf-8", "replace")}
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if body.get("logprobs"):
        choice["logprobs"] = _logprobs_block(ids, 0, True)
    out: dict[str, Any] = {
        "id": "chatcmpl-" + hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12],
        "object": "chat.completion", "created": int(time.time()), "model": body.get("model", "test-model"),
        "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)},
    }
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = prompt
        choice["token_ids"] = ids
    return out


def _completion_response(body: dict[str, Any]) -> dict[str, Any]:
    prompt_text = body.get("prompt") or ""
    if isinstance(prompt_text, list):
        prompt_ids = list(prompt_text) if prompt_text and isinstance(prompt_text[0], int) else tokenize(str(prompt_text[0]))
    else:
        prompt_ids = tokenize(prompt_text)
    ids, finish = _cap(tokenize(f"echo: {bytes(prompt_ids[-20:]).decode('utf-8', 'replace')}"), body)
    choice: dict[str, Any] = {"index": 0, "text": bytes(ids).decode("utf-8", "replace"), "finish_reason": finish,
                              "logprobs": _logprobs_block(ids, 0, False) if body.get("logprobs") is not None else None}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = ids
    return {"id": "cmpl-test", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model", "test-model"), "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)}}


def _stream_chunks(body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """The full response cut into SSE chunks of 4 tokens, vLLM-style."""
    # Build the whole answer with token IDs on, then drop them per chunk if not asked for.
    full_body = {**body, "return_token_ids": True}
    full = _chat_response(full_body) if chat else _completion_response(full_body)
    choice = full["choices"][0]
    ids = choice["token_ids"]
    head = {"id": full["id"], "created": full["created"], "model": full["model"],
            "object": "chat.completion.chunk" if chat else "text_completion"}
    chunks: list[dict[str, Any]] = []
    for start in range(0, max(len(ids), 1), 4):
        part = ids[start:start + 4]
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if start == 0 else {}
            if not choice["message"].get("tool_calls"):
                delta["content"] = bytes(part).decode("utf-8", "replace")
            c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        else:
            c = {"index": 0, "text": bytes(part).decode("utf-8", "replace"), "finish_reason": None, "logprobs": None}
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            c["logprobs"] = _logprobs_block(part, start, chat)
        if body.get("return_token_ids"):
            c["token_ids"] = part
        chunk = {**head, "choices": [c]}
        if start == 0 and body.get("return_token_ids"):
            if chat:
                chunk["prompt_token_ids"] = full["prompt_token_ids"]
            else:
                c["prompt_token_ids"] = choice["prompt_token_ids"]
        chunks.append(chunk)
    if chat and choice["message"].get("tool_calls"):
        tc = choice["message"]["tool_calls"][0]
        args = tc["function"]["arguments"]
        chunks.append({**head, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "id": tc["id"], "type": "function", "function": {"name": tc["function"]["name"], "arguments": ""}}]}}]})
        chunks.append({**head, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": args}}]}}]})
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": choice["finish_reason"]}]})
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


def _burn(seconds: float) -> None:
    """Compute for `seconds` of this thread's CPU time (not wall time: on a busy machine it takes longer,
    as a real engine's work would). On the event loop, so completions are computed one at a time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def build_app(latency_s: float = 0.0, cpu_s: float = 0.0) -> Any:
    """The ASGI app. `latency_s`: time every completion takes, as an engine's generation would.

    `cpu_s`: CPU time every completion computes, one completion at a time on the server's
    event loop, like a CPU inference engine that fills a core: throughput is at most 1/cpu_s
    and whatever else runs on the machine competes with it for cores.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": {"message": "invalid JSON", "type": "invalid_request_error"}}, 400)
        if request.headers.get("x-test-strict") and set(body) - _KNOWN_FIELDS:
            return JSONResponse({"error": {"message": f"unknown fields {sorted(set(body) - _KNOWN_FIELDS)}",
                                           "type": "invalid_request_error"}}, 400)
        fail_times = int(request.headers.get("x-test-fail-times", "0"))
        if fail_times:
            key = hashlib.sha256(raw).hexdigest()
            if _fail_counts[key] < fail_times:
                _fail_counts[key] += 1
                return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, 500)
        path = request.url.path
        seen = {"x-test-received-headers": ",".join(sorted(request.headers.keys()))}
        if path.endswith("/responses"):
            return JSONResponse(_responses_response(body), headers=seen)
        chat = path.endswith("/chat/completions")
        if latency_s:
            await asyncio.sleep(latency_s)
        if cpu_s:
            _burn(cpu_s)
        if not body.get("stream"):
            return JSONResponse(_chat_response(body) if chat else _completion_response(body), headers=seen)
        delay = float(request.headers.get("x-test-delay", "0"))

        async def events() -> Any:
            for chunk in _stream_chunks(body, chat):
                if delay:
                    await asyncio.sleep(delay)
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=seen)

    async def models(_request: Request) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": "test-model", "object": "model", "owned_by": "test"}]})

    async def tokenize_route(request: Request) -> Any:
        body = await request.json()
        text = render_chat(body["messages"]) if "messages" in body else body.get("prompt", "")
        ids = tokenize(text)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def health(_request: Request) -> Any:
        return JSONResponse({"ok": True})

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env() -> dict[str, str]:
    """This process's environment, with our package importable even from a source checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": root + (os.pathsep + path if path else "")}


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (Linux /proc), None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class LLMTestServer:
    """The test server in a subprocess: `with LLMTestServer() as srv: OpenAI(base_url=srv.base_url)`."""

    def __init__(self, port: int | None = None, *, latency_ms: float = 0.0, cpu_ms: float = 0.0) -> None:
        self.port = port or free_port()
        self.latency_ms = latency_ms
        self.cpu_ms = cpu_ms
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs (e.g. for process_cpu_seconds)."""
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = 30.0) -> "LLMTestServer":
        import httpx

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_middleware.testing", "--port", str(self.port),
             "--latency-ms", str(self.latency_ms), "--cpu-ms", str(self.cpu_ms)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_child_env(),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"test LLM server exited: {err[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError("test LLM server did not come up")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def __enter__(self) -> "LLMTestServer":
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="deterministic OpenAI-compatible test server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="time each completion takes")
    parser.add_argument("--cpu-ms", type=float, default=0.0,
                        help="CPU each completion computes, one at a time (an engine that fills a core)")
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.latency_ms / 1000, args.cpu_ms / 1000), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()


class PostgresTestServer:
    """A throwaway PostgreSQL cluster on loopback, from the Debian `postgresql` package.

    Runs as the `postgres` user when we are root (PostgreSQL refuses root).
    `stop()` / `start()` keep the data directory, so tests can take the database
    away mid-run and bring it back.
    """

    def __init__(self, *, port: int | None = None, durable: bool = False) -> None:
        import glob
        import shutil
        import tempfile

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        bindir = os.path.dirname(found[-1]) if found else os.path.dirname(shutil.which("initdb") or "")
        if not bindir:
            raise RuntimeError("PostgreSQL server binaries not found: apt-get install postgresql")
        self.bindir = bindir
        self.port = port or free_port()
        self.durable = durable
        self.root = tempfile.mkdtemp(prefix="lightning-pg-")
        self.datadir = os.path.join(self.root, "data")
        self.url = f"postgresql+psycopg://lightning@127.0.0.1:{self.port}/lightning_test"
        self._initialised = False

    def _run(self, *args: str) -> None:
        cmd = [os.path.join(self.bindir, args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")

    def start(self) -> "PostgresTestServer":
        if not self._initialised:
            if os.geteuid() == 0:
                import shutil

                shutil.chown(self.root, "postgres", "postgres")
            self._run("initdb", "-D", self.datadir, "-U", "lightning", "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not self.durable:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", self.datadir, "-o", opts, "-l", os.path.join(self.root, "log"), "-w", "start")
        if not self._initialised:
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "lightning", "lightning_test")
            self._initialised = True
        return self

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.datadir, "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        import shutil

        try:
            self.stop()
        except RuntimeError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PostgresTestServer":
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.destroy()
