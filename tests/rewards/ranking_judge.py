"""A ranking judge for the tests: a real OpenAI-compatible HTTP server on loopback whose answers
are scripted per test, either a list of replies (one per request, the last repeated) or
`by_errors`: a judge that reads the candidates and ranks those whose transcript shows an error
last (ties among equals)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Script = Callable[[dict[str, Any]], str]


@dataclass
class Judge:
    url: str
    script: list[str] | Script
    seen: list[dict[str, Any]] = field(default_factory=list)

    def answer(self, body: dict[str, Any]) -> str:
        self.seen.append(body)
        if callable(self.script):
            return self.script(body)
        return self.script[min(len(self.seen), len(self.script)) - 1]


def candidates(body: dict[str, Any]) -> dict[str, str]:
    """Letter -> that candidate's section of the first user message."""
    text = next(m["content"] for m in body["messages"] if m["role"] == "user")
    parts = re.split(r"=== Candidate ([A-Z]{1,2}) ===\n", text)
    return dict(zip(parts[1::2], parts[2::2]))


def by_errors(body: dict[str, Any]) -> str:
    """'Ranking: ...' with the candidates that show no "error" first, tied among themselves."""
    cands = candidates(body)
    good = [c for c, text in cands.items() if "error" not in text.lower()]
    bad = [c for c in cands if c not in good]
    return "Ranking: " + " > ".join(" = ".join(tier) for tier in (good, bad) if tier) + ". Errors rank last."


def slow(script: Script, latency: float, peak: list[int]) -> Script:
    """`script`, answering after `latency` s; `peak[0]` records the most requests in flight at once."""
    lock, inflight = threading.Lock(), [0]

    def answer(body: dict[str, Any]) -> str:
        with lock:
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
        time.sleep(latency)
        with lock:
            inflight[0] -= 1
        return script(body)

    return answer


def _handler(judge: Judge) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            reply = judge.answer(body)
            out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out.encode())

        def log_message(self, *_args: Any) -> None:
            pass

    return Handler


@contextmanager
def ranking_judge(script: list[str] | Script = by_errors) -> Iterator[Judge]:
    judge = Judge("", script)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(judge))
    judge.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield judge
    finally:
        server.shutdown()
        server.server_close()
