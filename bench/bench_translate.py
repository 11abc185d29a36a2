"""Translation overhead: Responses API and Anthropic Messages vs plain chat completions, through
the same gateway, in one run.

    python bench/bench_translate.py [--seq 300] [--inproc 2000]

Starts the deterministic test server and `lightning-mw gateway` (SQLite store in a temp dir) as
subprocesses on loopback (bench_gateway.py's helpers), then measures from this process with an
aiohttp client, one call at a time, round-robin over the three formats so that all see the same
machine state:

- `chat`: POST /v1/chat/completions (what the gateway forwards as it is),
- `responses`: POST /v1/responses, the same conversation (`instructions` + `input`),
- `messages`: POST /v1/messages, the same conversation (`system` + `messages`),

non-streaming and streaming, each call distinct (nothing is replayed) and recorded. The engine
answers all three alike (the translated request is the chat request), so the p50 difference is
what translating the request and the answer adds. It also times the translation alone in this
process (request -> chat, chat answer -> caller's answer; the stream's chunks -> caller's
events), which is the same cost without the loopback noise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

import aiohttp
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gateway import _one, _pct, _rollout_urls, _start_gateway  # noqa: E402

from lightning_middleware.formats import FORMATS, Format  # noqa: E402
from lightning_middleware.testing import LLMTestServer, free_port  # noqa: E402
from lightning_middleware.testing.llm_script import reply  # noqa: E402

SYSTEM = "be brief"


def _bodies(i: int, stream: bool, salt: str) -> dict[str, dict]:
    """The same conversation in each format (question `i`, distinct per call)."""
    question = f"question number {i}: what is {i}+{i}? [{salt}]"
    return {
        "chat": {"model": "m", "max_tokens": 32, "stream": stream,
                 "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]},
        "responses": {"model": "m", "max_output_tokens": 32, "stream": stream, "instructions": SYSTEM,
                      "input": [{"role": "user", "content": question}]},
        "messages": {"model": "m", "max_tokens": 32, "stream": stream, "system": SYSTEM,
                     "messages": [{"role": "user", "content": question}]},
    }


async def _interleaved(base: str, stream: bool, total: int) -> dict[str, list[float]]:
    lat: dict[str, list[float]] = {"chat": [], "responses": [], "messages": []}
    paths = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}
    salt = uuid.uuid4().hex[:6]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        for name, body in _bodies(-1, stream, "warm" + salt).items():
            await _one(client, base + paths[name], body)
        for i in range(total):
            for name, body in _bodies(i, stream, salt).items():
                lat[name].append(await _one(client, base + paths[name], body))
    return lat


def _steps(fmt: Format, source: dict, answer: bytes, chunks: tuple[bytes, ...]) -> dict[str, Callable[[], object]]:
    """The three translation steps of one call, each as a thunk to time."""

    def stream() -> bytes:
        rewriter = fmt.stream_rewriter(source, "id")
        return b"".join(rewriter.feed(c) for c in chunks) + rewriter.finish()

    return {
        "request": lambda: orjson.dumps(fmt.to_chat(orjson.loads(orjson.dumps(source)), None)),
        "answer": lambda: fmt.answer_body(answer, source, "id"),
        "stream": stream,
    }


def _inproc(n: int) -> dict[str, dict[str, float]]:
    """Microseconds per call of the translation alone: request, whole answer, and stream."""
    out: dict[str, dict[str, float]] = {}
    for name, route in (("responses", "responses"), ("messages", "messages")):
        fmt = FORMATS[route]
        source = _bodies(7, False, "x")[name]
        chat = fmt.to_chat(source, None)
        answer = reply("/v1/chat/completions", {}, orjson.dumps({**chat, "return_token_ids": True,
                                                                  "logprobs": True})).json_bytes()
        chunks = reply("/v1/chat/completions", {}, orjson.dumps(
            {**fmt.to_chat({**source, "stream": True}, None), "return_token_ids": True, "logprobs": True})).events
        timings = {}
        for what, fn in _steps(fmt, source, answer, chunks).items():
            fn()
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            timings[what] = _pct(samples, 50) * 1e6
        out[name] = timings
    return out


def _stream_len() -> int:
    chat = FORMATS["responses"].to_chat({**_bodies(7, True, "x")["responses"]}, None)
    return len(reply("/v1/chat/completions", {}, orjson.dumps({**chat, "return_token_ids": True})).events)


def _cpu_kind() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or "unknown"
    kind = "AVX512-BF16" if "avx512_bf16" in flags else "AVX2" if "avx2" in flags else "other"
    return f"{kind}, {os.cpu_count()} cores"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=300, help="sequential calls per format and mode")
    ap.add_argument("--inproc", type=int, default=2000, help="repetitions of the in-process timing")
    args = ap.parse_args()
    print(f"CPU: {_cpu_kind()}")
    inproc = _inproc(args.inproc)
    print("translation alone, p50 microseconds: request -> chat | chat answer -> caller | stream chunks -> events")
    for name, t in inproc.items():
        print(f"  {name:9s}  {t['request']:7.1f} | {t['answer']:7.1f} | {t['stream']:7.1f}")
    print(f"  (a stream: {_stream_len()} chat chunks)")
    tmp = tempfile.mkdtemp(prefix="bench_tr_")
    with LLMTestServer() as server:
        port = free_port()
        gw = _start_gateway(server.base_url, f"sqlite:///{tmp}/traces.db", port, os.path.join(tmp, "gateway.log"))
        try:
            [rid], _ = _rollout_urls(f"http://127.0.0.1:{port}", 1)
            base = f"http://127.0.0.1:{port}/rollouts/{rid}/v1"
            print("through the gateway, sequential, p50 ms (added vs chat)")
            for stream in (False, True):
                lat = asyncio.run(_interleaved(base, stream, args.seq))
                chat = _pct(lat["chat"], 50) * 1000
                # (added: p50 minus chat's p50; paired: the p50 of each round's own difference,
                # less sensitive to the machine's load drifting during the run)
                row = "  ".join(f"{name} {_pct(v, 50) * 1000:.3f} (added {_pct(v, 50) * 1000 - chat:+.3f}, "
                                f"paired {_pct([a - b for a, b in zip(v, lat['chat'])], 50) * 1000:+.3f})"
                                for name, v in lat.items() if name != "chat")
                print(f"  {'stream    ' if stream else 'non-stream'}  chat {chat:.3f}  {row}   n={len(lat['chat'])}")
        finally:
            gw.terminate()
            try:
                gw.wait(10)
            except subprocess.TimeoutExpired:
                gw.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
