"""The deterministic test LLM (`llm_script`) as a real HTTP server, in a subprocess.

    with LLMTestServer() as srv:
        client = OpenAI(base_url=srv.base_url, api_key="-")

Run it by hand with `python -m lightning_middleware.testing.llm_server --port 8011`. Where a
test does not need a socket, `LLMTestTransport` serves the same answers in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from lightning_middleware.testing.llm_script import MODELS, reply, tokenize_reply


def _burn(seconds: float) -> None:
    """Compute for `seconds` of this thread's CPU time (not wall time: on a busy machine it takes longer,
    as a real engine's work would). On the event loop, so completions are computed one at a time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


HOLD_LIMIT_S = 60.0  # a held stream that is never released finishes anyway: a failing test must not hang


def build_app(latency_s: float = 0.0, cpu_s: float = 0.0) -> Any:
    """The ASGI app. `latency_s`: time every completion takes, as an engine's generation would.

    `cpu_s`: CPU time every completion computes, one completion at a time on the server's
    event loop, like a CPU inference engine that fills a core: throughput is at most 1/cpu_s
    and whatever else runs on the machine competes with it for cores.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    holds: dict[str, asyncio.Event] = {}  # x-test-hold keys, released by POST /test/release
    seen: Counter[str] = Counter()  # x-test-tag: requests that arrived, read by GET /test/seen/TAG

    async def completions(request: Request) -> Any:
        if tag := request.headers.get("x-test-tag"):
            seen[tag] += 1
        answer = reply(request.url.path, request.headers, await request.body())
        if answer.hang_s:
            await asyncio.sleep(answer.hang_s)
        if answer.status == 200 and not request.url.path.endswith("/responses"):
            if latency_s:
                await asyncio.sleep(latency_s)
            if cpu_s:
                _burn(cpu_s)
        if not answer.stream:
            return Response(answer.json_bytes(), answer.status, headers=answer.headers,
                            media_type="application/json")

        async def events() -> Any:
            for i, event in enumerate(answer.events):
                if answer.close_after is not None and i >= answer.close_after:
                    # An exception in the body iterator makes uvicorn drop the connection without the
                    # chunked body's terminator: the client sees the stream cut, as when an engine dies.
                    raise ConnectionAbortedError("x-test-close-after: connection dropped mid-stream")
                if answer.delay_s:
                    await asyncio.sleep(answer.delay_s)
                if i == 1 and answer.hold is not None:
                    await _wait(holds.setdefault(answer.hold, asyncio.Event()))
                yield event

        return StreamingResponse(events(), media_type="text/event-stream", headers=answer.headers)

    async def models(_request: Request) -> Any:
        return JSONResponse(MODELS)

    async def tokenize_route(request: Request) -> Any:
        return JSONResponse(tokenize_reply(await request.body()))

    async def release(request: Request) -> Any:
        holds.setdefault(str((await request.json())["key"]), asyncio.Event()).set()
        return JSONResponse({"released": True})

    async def seen_route(request: Request) -> Any:
        return JSONResponse({"seen": seen[request.path_params["tag"]]})

    async def health(_request: Request) -> Any:
        return JSONResponse({"ok": True})

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/test/release", release, methods=["POST"]),
        Route("/test/seen/{tag}", seen_route, methods=["GET"]),
    ])


async def _wait(event: asyncio.Event) -> None:
    try:
        await asyncio.wait_for(event.wait(), HOLD_LIMIT_S)
    except asyncio.TimeoutError:
        logging.getLogger(__name__).warning("x-test-hold: never released, the stream goes on")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env() -> dict[str, str]:
    """This process's environment, with our package importable even from a source checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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

    def start(self, timeout: float = 30.0) -> LLMTestServer:
        import httpx

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_middleware.testing.llm_server", "--port", str(self.port),
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

    def release(self, key: str) -> None:
        """Let the streams held with `x-test-hold: key` finish (also those that have not started yet)."""
        import httpx

        httpx.post(self.url + "/test/release", json={"key": key}, timeout=10).raise_for_status()

    def seen(self, tag: str) -> int:
        """How many requests tagged `x-test-tag: tag` have reached the server so far."""
        import httpx

        r = httpx.get(f"{self.url}/test/seen/{tag}", timeout=10)
        r.raise_for_status()
        return int(r.json()["seen"])

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def __enter__(self) -> LLMTestServer:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()


class _DroppedOnPurpose(logging.Filter):
    """Keep uvicorn from logging a traceback for each x-test-close-after drop: the server's stderr is a pipe
    nobody drains while it runs, and a few dozen tracebacks would fill it and stall the server."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ConnectionAbortedError))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="deterministic OpenAI-compatible test server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="time each completion takes")
    parser.add_argument("--cpu-ms", type=float, default=0.0,
                        help="CPU each completion computes, one at a time (an engine that fills a core)")
    args = parser.parse_args(argv)
    logging.getLogger("uvicorn.error").addFilter(_DroppedOnPurpose())
    # Idle connections stay open 75 s, as the gateway's and our vLLM servers' (docs/reliability.md):
    # with uvicorn's 5 s a client pool reusing a connection just as the server closes it fails the
    # request (LiteLLM's aiohttp pool keeps them 15 s: "Cannot write to closing transport" in CI).
    uvicorn.run(build_app(args.latency_ms / 1000, args.cpu_ms / 1000), host=args.host, port=args.port,
                log_level="warning", access_log=False, timeout_keep_alive=75)


if __name__ == "__main__":
    main()
