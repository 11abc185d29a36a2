"""Agent functions for the controller tests and benchmark.

Module-level so worker processes and Ray actors can import them. Each builds its
wrapped client lazily, once per process, from what the task carries.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import openai

from lightning_middleware import TraceStore, wrap
from lightning_middleware.capture import current_rollout
from lightning_middleware.testing import LLMTestServer

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a fact up",
                                           "parameters": {"type": "object",
                                                          "properties": {"query": {"type": "string"}}}}}]
# The timeout of runs whose rollouts must all finish: a short one cut ~0.4 s rollouts short on a loaded
# CI machine. A test of the timeout itself gives the sleeping task a run of its own, with a short one.
UNREACHED_TIMEOUT_S = 120.0
_clients: dict[tuple[str, str, int], Any] = {}
_lock = threading.Lock()


def _client(task: dict[str, Any], is_async: bool) -> Any:
    # An async client's connections belong to one event loop: one client per loop.
    key = (task["base_url"], task["store"], id(asyncio.get_running_loop()) if is_async else 0)
    with _lock:
        if key not in _clients:
            cls = openai.AsyncOpenAI if is_async else openai.OpenAI
            _clients[key] = wrap(cls(base_url=task["base_url"], api_key="x", max_retries=0), store=task["store"])
        return _clients[key]


def _messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": task.get("question", "q")}]


def tool_agent(task: dict[str, Any]) -> float:
    """Sync openai tool loop: tool call, then answer (2 LLM calls). Optional sleep/hang/crash."""
    client = _client(task, False)
    messages = _messages(task)
    for _ in range(4):
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if task.get("pidfile") and not os.path.exists(task["pidfile"]) and _announce(task["pidfile"]):
            time.sleep(60)  # wait to be killed
        if task.get("sleep"):
            time.sleep(task["sleep"])
        if task.get("crash"):
            raise ValueError("tool exploded")
        if task.get("exit_code"):  # the agent's process dies without reporting (a segfault, os._exit)
            current_rollout().store.flush()
            print("\n".join(f"agent log line {i}" for i in range(30)), flush=True)
            os._exit(int(task["exit_code"]))
        if not reply.tool_calls:
            return _reward(task)
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"fact {args}"})
    return 0.0


def _reward(task: dict[str, Any]) -> float:
    """The task's `reward` (default 1), or, where it has `reward_by_version`, the one listed for the
    policy version serving the rollout: an evaluation whose score changes as training goes on."""
    by_version = task.get("reward_by_version")
    if by_version is not None:
        return float(by_version[str(current_rollout().policy_version)])
    return float(task.get("reward", 1.0))


async def async_tool_agent(task: dict[str, Any]) -> float:
    client = _client(task, True)
    messages = _messages(task)
    for _ in range(4):
        reply = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if task.get("sleep"):
            await asyncio.sleep(task["sleep"])
        if task.get("crash"):
            raise ValueError("tool exploded")
        if not reply.tool_calls:
            return float(task.get("reward", 1.0))
        messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "fact"})
    return 0.0


async def noop_agent(task: dict[str, Any]) -> float:
    return 1.0


def sync_noop_agent(task: dict[str, Any]) -> float:
    return 1.0


def exit_agent(task: dict[str, Any]) -> float:
    """Dies without reporting, after some output (no LLM): a non-zero pod exit, on a real cluster too."""
    print("\n".join(f"agent log line {i}" for i in range(30)), flush=True)
    os._exit(int(task.get("exit_code", 3)))


def dies_before_reporting(task: dict[str, Any]) -> float:
    """Succeeds, and its worker process dies after the rollout ended in the store, before the
    outcome reaches the controller (the pipe's send: an OOM kill in the worker's teardown)."""
    import multiprocessing.connection

    from lightning_middleware.store import get_store

    def die(self: Any, obj: Any) -> None:
        get_store(task["store"]).flush()  # the rollout's end is written: the window is after it
        os._exit(9)

    multiprocessing.connection.Connection.send = die  # type: ignore[method-assign]
    return 1.0


def max_overlap(rollouts: Any) -> int:
    """Most rollouts running at once, from the store's created_at/ended_at."""
    events = []
    for r in rollouts:
        events.append((r.created_at, 1))
        events.append((r.ended_at or r.created_at, -1))
    best = cur = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def _announce(pidfile: str) -> bool:
    """Write this process's pid to `pidfile` unless another rollout of the task got there first.

    The rollouts of one task run side by side, so the pid goes to a file of its own and is then
    hard-linked into place: the link is atomic and fails if the pidfile exists, so exactly one
    agent is killed and the others finish their rollouts.
    """
    current_rollout().store.flush()  # the span is on disk before we announce ourselves
    tmp = f"{pidfile}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    try:
        os.link(tmp, pidfile)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)


class Killer:
    """A thread that SIGKILLs the worker whose agent writes its pid to `pidfile`. It waits for the
    announcement however long the workers take to start (a fixed 60 s ran out while Ray's actors
    started under load), until `join()`, called once the run is over, says to stop waiting."""

    def __init__(self, pidfile: str) -> None:
        self.pidfile = pidfile
        self.killed: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="killer")
        self._thread.start()

    def _run(self) -> None:
        import signal

        while not os.path.exists(self.pidfile):
            if self._done.wait(0.02):
                return
        with open(self.pidfile) as f:
            self.killed = int(f.read())
        os.kill(self.killed, signal.SIGKILL)

    def join(self) -> None:
        self._done.set()
        self._thread.join()


def make_tasks(server: LLMTestServer, store: TraceStore, n: int, **extra: Any) -> list[dict[str, Any]]:
    """n tasks for these agents, each naming the test LLM server and the store URL."""
    url = store.url.render_as_string(hide_password=False)
    return [{"task_id": f"t{i}", "question": f"what is {i}?", "base_url": server.base_url, "store": url, **extra}
            for i in range(n)]
