"""The agents of the soak (bench/bench_soak.py): one process of asyncio agents, in one of two kinds.

    python bench/soak_agents.py --kind wrap    --llm URL --store PG_URL --agents 16 --seconds 1800
    python bench/soak_agents.py --kind gateway --gateway URL             --agents 16 --seconds 1800

- `wrap`: each agent is a task of this process, calling the test LLM server through a
  `wrap()`-ed `AsyncOpenAI` inside `async with rollout(...)`, the store written from here;
- `gateway`: each agent creates its rollout on the gateway, calls through the rollout's base URL
  with a plain httpx client (as an out-of-process agent does), and finishes it with its reward.

Every rollout is two calls (the second one streamed, continuing the first answer, so the trainer
merges them into one row), and the four rollouts of a task are one GRPO group with rewards
1, 0, 1, 0 (every group carries signal, so every rollout is trained, none skipped). An agent
checks the deadline between groups only: it never leaves a group short.

Each `--window-s` the process prints one JSON line with that window's calls, failures and latency
p50/p99; at the end a line with `"final": true` and its totals: calls sent (every HTTP attempt;
the clients do not retry, so one attempt is one call), answered, failed (with each failure's
exception and message: whether the server ever read the request), rollouts finished.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GROUP_SIZE = 4  # rollouts per task: the trainer's --group-size
MAX_FAILURES = 50  # failures reported one by one in the final line


@dataclass
class Tally:
    """What this process's agents did: the numbers the store is checked against."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    rollouts: int = 0
    window: list[float] = field(default_factory=list)  # latencies (s) of the current window
    window_failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # "Class: message" -> count
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_FAILURES, in detail
    control_retries: dict[str, int] = field(default_factory=dict)  # rollout create/finish retried, by error

    def record(self, seconds: float, ok: bool, error: BaseException | None = None, **where: Any) -> None:
        self.sent += 1
        self.window.append(seconds)
        if ok:
            self.ok += 1
            return
        self.failed += 1
        self.window_failed += 1
        # Why a call failed decides whether the store should hold it: a request the server never read
        # (a connection reset, "Server disconnected without sending a response") cannot be recorded.
        what = describe(error)
        self.errors[what] = self.errors.get(what, 0) + 1
        if len(self.failures) < MAX_FAILURES:
            self.failures.append({"at": time.time(), "seconds": round(seconds, 3), "error": what, **where})


def describe(error: BaseException | None) -> str:
    if error is None:
        return "unknown"
    status = getattr(getattr(error, "response", None), "status_code", None)
    text = f"{type(error).__name__}: {error}"[:200]
    return f"{text} (HTTP {status})" if status is not None else text


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def messages(task: str, sample: int, answer: str | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": f"soak task {task} sample {sample}: what is {len(task) + sample}?"}]
    if answer is not None:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    return msgs


async def wrap_agent(k: int, client: Any, store: Any, deadline: float, tally: Tally, think_s: float) -> None:
    from lightning_middleware import rollout

    n = 0
    while time.monotonic() < deadline:
        task = f"w{os.getpid()}-{k}-{n}"
        for s in range(GROUP_SIZE):
            async with rollout(task, store=store) as r:
                answer = await _wrap_call(client, messages(task, s), tally, stream=False)
                await asyncio.sleep(think_s)
                await _wrap_call(client, messages(task, s, answer or ""), tally, stream=True)
                r.reward(float(s % 2 == 0))
            tally.rollouts += 1
            await asyncio.sleep(think_s)
        n += 1


async def _wrap_call(client: Any, msgs: list[dict[str, str]], tally: Tally, *, stream: bool) -> str | None:
    t0 = time.perf_counter()
    try:
        if stream:
            text = []
            async for chunk in await client.chat.completions.create(model="m", messages=msgs, max_tokens=12,
                                                                    stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
            answer: str | None = "".join(text)
        else:
            out = await client.chat.completions.create(model="m", messages=msgs, max_tokens=12)
            answer = out.choices[0].message.content
    except Exception as exc:  # noqa: BLE001 - a failed call is counted (and must be recorded), the agent goes on
        tally.record(time.perf_counter() - t0, ok=False, error=exc, stream=stream)
        return None
    tally.record(time.perf_counter() - t0, ok=True)
    return answer


async def gateway_agent(k: int, http: httpx.AsyncClient, deadline: float, tally: Tally, think_s: float) -> None:
    n = 0
    while time.monotonic() < deadline:
        task = f"g{os.getpid()}-{k}-{n}"
        for s in range(GROUP_SIZE):
            rid = f"{task}-{s}"
            await _control(http, "/rollouts", {"task_id": task, "id": rid}, tally)
            base = f"/rollouts/{rid}/v1/chat/completions"
            answer = await _gateway_call(http, base, messages(task, s), tally, stream=False)
            await asyncio.sleep(think_s)
            await _gateway_call(http, base, messages(task, s, answer or ""), tally, stream=True)
            await _control(http, f"/rollouts/{rid}/finish", {"reward": float(s % 2 == 0)}, tally)
            tally.rollouts += 1
            await asyncio.sleep(think_s)
        n += 1


async def _control(http: httpx.AsyncClient, path: str, body: dict[str, Any], tally: Tally, attempts: int = 3) -> None:
    """Create or finish a rollout as GatewayClient does: retried on a connection error, which is
    safe (the id is chosen here, a finish is idempotent); the retries are counted and reported."""
    for attempt in range(attempts):
        try:
            (await http.post(path, json=body)).raise_for_status()
            return
        except httpx.TransportError as exc:
            if attempt == attempts - 1:
                raise
            what = describe(exc)
            tally.control_retries[what] = tally.control_retries.get(what, 0) + 1
            await asyncio.sleep(0.2 * (attempt + 1))


async def _gateway_call(http: httpx.AsyncClient, url: str, msgs: list[dict[str, str]], tally: Tally, *,
                        stream: bool) -> str | None:
    body = {"model": "m", "messages": msgs, "max_tokens": 12, "stream": stream}
    t0 = time.perf_counter()
    try:
        if stream:
            text = []
            async with http.stream("POST", url, json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = orjson.loads(line[6:])["choices"][0].get("delta", {})
                        text.append(delta.get("content") or "")
            answer: str | None = "".join(text)
        else:
            r = await http.post(url, json=body)
            r.raise_for_status()
            answer = r.json()["choices"][0]["message"]["content"]
    except Exception as exc:  # noqa: BLE001 - counted as failed; the gateway records it as a failed call
        tally.record(time.perf_counter() - t0, ok=False, error=exc, stream=stream, url=url)
        return None
    tally.record(time.perf_counter() - t0, ok=True)
    return answer


def emit(line: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(line).decode() + "\n")
    sys.stdout.flush()


async def report_windows(tally: Tally, kind: str, window_s: float, stop: asyncio.Event, deadline: float) -> None:
    """One JSON line per window: what the orchestrator's table shows as p50/p99 over time."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), window_s)
        except TimeoutError:
            pass
        lat, tally.window = tally.window, []
        failed, tally.window_failed = tally.window_failed, 0
        if not lat and not failed and time.monotonic() >= deadline:
            # Past the deadline the agents only finish their last calls and close the store: a
            # window there may hold none (seen under load: a p99 of None in the soak test).
            continue
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        emit({"kind": kind, "at": time.time(), "calls": len(lat), "failed": failed,
              "p50_ms": None if p50 is None else p50 * 1000, "p99_ms": None if p99 is None else p99 * 1000,
              "sent": tally.sent, "rollouts": tally.rollouts})


async def run(args: argparse.Namespace) -> None:
    tally = Tally()
    deadline = time.monotonic() + args.seconds
    think = args.think_ms / 1000
    stop = asyncio.Event()
    reporter = asyncio.create_task(report_windows(tally, args.kind, args.window_s, stop, deadline))
    limits = httpx.Limits(max_connections=args.agents * 2, max_keepalive_connections=args.agents * 2)
    timeout = httpx.Timeout(120.0)
    if args.kind == "wrap":
        import openai

        from lightning_middleware import TraceStore, wrap

        store = TraceStore(args.store)
        client = wrap(openai.AsyncOpenAI(base_url=args.llm, api_key="unused", max_retries=0, timeout=120.0),
                      store=store)
        await asyncio.gather(*(wrap_agent(k, client, store, deadline, tally, think) for k in range(args.agents)))
        await client.close()
        await asyncio.to_thread(store.close)  # flushes what is still queued
    else:
        async with httpx.AsyncClient(base_url=args.gateway, limits=limits, timeout=timeout) as http:
            await asyncio.gather(*(gateway_agent(k, http, deadline, tally, think) for k in range(args.agents)))
    stop.set()
    await reporter
    emit({"kind": args.kind, "final": True, "sent": tally.sent, "ok": tally.ok, "failed": tally.failed,
          "rollouts": tally.rollouts, "pid": os.getpid(), "errors": tally.errors, "failures": tally.failures,
          "control_retries": tally.control_retries})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("wrap", "gateway"), required=True)
    p.add_argument("--llm", help="the LLM server's /v1 URL (wrap)")
    p.add_argument("--store", help="the trace store URL (wrap)")
    p.add_argument("--gateway", help="the gateway's URL (gateway)")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--seconds", type=float, required=True, help="start no new group after this")
    p.add_argument("--think-ms", type=float, default=100.0, help="pause after each call, as an agent's tools take")
    p.add_argument("--window-s", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.kind == "wrap" and not (args.llm and args.store):
        p.error("--kind wrap needs --llm and --store")
    if args.kind == "gateway" and not args.gateway:
        p.error("--kind gateway needs --gateway")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
