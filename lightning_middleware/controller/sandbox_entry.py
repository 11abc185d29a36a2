"""What runs inside a sandboxed rollout (backends/sandboxed.py starts it under bwrap).

It reads its spec as JSON on stdin: the agent ("module:function"), the task, the rollout's id,
and the file descriptor for its result. It opens a loopback port that relays to the door's Unix
socket (the sandbox's only way out), so the agent's client keeps an ordinary base URL
(OPENAI_BASE_URL, LIGHTNING_GATEWAY_URL); then it runs the agent and writes one JSON result:
`{"ok": true, "value": ...}` or `{"ok": false, "error": ..., "types": [...], "breach": kind|null}`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import threading
from typing import Any

from lightning_middleware.controller.execution import resolve_agent
from lightning_middleware.controller.jobs import type_names
from lightning_middleware.controller.sandbox import DOOR_PATH, classify


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


async def _relay_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        door_r, door_w = await asyncio.open_unix_connection(DOOR_PATH)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pump(reader, door_w), _pump(door_r, writer))


def start_relay() -> int:
    """A loopback TCP port relaying each connection to the door (one thread, one event loop: the
    sandbox's process limit counts threads)."""
    ready: list[int] = []
    started = threading.Event()

    def serve() -> None:
        async def main() -> None:
            server = await asyncio.start_server(_relay_one, "127.0.0.1", 0)
            ready.append(server.sockets[0].getsockname()[1])
            started.set()
            async with server:
                await server.serve_forever()

        asyncio.run(main())

    threading.Thread(target=serve, name="lightning-door-relay", daemon=True).start()
    if not started.wait(30):
        raise RuntimeError("the sandbox's relay to the gateway did not start")
    return ready[0]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    workspace = os.getcwd()
    try:
        port = start_relay()
        base = f"http://127.0.0.1:{port}"
        rid = spec["rollout_id"]
        os.environ.update({"LIGHTNING_GATEWAY_URL": base, "LIGHTNING_ROLLOUT_ID": rid,
                           "OPENAI_BASE_URL": f"{base}/rollouts/{rid}/v1", "OPENAI_API_KEY": "sandboxed"})
        agent = resolve_agent(spec["agent"])
        if inspect.iscoroutinefunction(agent):
            value = asyncio.run(agent(spec["task"]))
        else:
            value = agent(spec["task"])
        json.dumps(value)  # what cannot travel back is the agent's error, said here
        return {"ok": True, "value": value}
    except BaseException as exc:  # noqa: BLE001 - every ending is reported, SystemExit included
        breach = classify(exc, workspace)
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return {"ok": False, "error": text[:4000], "types": type_names(type(exc)),
                "breach": None if breach is None else breach.kind}


def main() -> int:
    spec = json.loads(sys.stdin.read())
    result = run(spec)
    data = json.dumps(result, default=str).encode()
    fd = int(spec["result_fd"])
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)
    sys.stdout.flush()
    os._exit(0)  # the relay thread and anything the agent left running end with the sandbox


if __name__ == "__main__":
    sys.exit(main())
