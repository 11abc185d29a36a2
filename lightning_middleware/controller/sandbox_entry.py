"""What runs inside a sandboxed rollout (backends/sandboxed.py starts it under bwrap, by its path).

It imports only the standard library, so a rollout starts in a bare interpreter's time; the agent
brings its own imports. It reads its spec as JSON on stdin: the agent ("module:function"), the
task, the rollout's id, and the file descriptor for its result. It opens a loopback port that
relays to the door's Unix socket (the sandbox's only way out), so the agent's client keeps an
ordinary base URL (OPENAI_BASE_URL, LIGHTNING_GATEWAY_URL); then it runs the agent and writes one
JSON result: `{"ok": true, "value": ...}` or `{"ok": false, "error": ..., "types": [...],
"breach": kind|null}`, `kind` one of `BREACH_KINDS` (controller/jobs.py has their classes).
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import inspect
import json
import os
import socket
import sys
import threading
from typing import Any

DOOR_PATH = "/run/lightning/door.sock"
# Set in a sandboxed rollout's environment, here and in a sandboxed Kubernetes pod (whose worker then
# classes an error as this module does: execution.failure).
ENV_SANDBOX = "LIGHTNING_SANDBOX"  # "1"
ENV_SANDBOX_WORKSPACE = "LIGHTNING_SANDBOX_WORKSPACE"  # the work directory's path
BREACH_KINDS = ("sandbox_network", "sandbox_fs", "sandbox_limit", "sandbox_reward")
_NET_ERRNOS = {errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.ENETDOWN}
_FS_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_NET_TYPES = ("APIConnectionError", "ConnectError", "ConnectTimeout")  # openai's and httpx's wrappers


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 20:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def under(path: str, root: str) -> bool:
    """Is `path` `root` or inside it (as strings: no file system access)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def classify(exc: BaseException, workspace: str) -> str | None:
    """The breach an exception that ended the agent stands for, or None (the agent's own error).
    It looks down the exception's chain: an SDK's connection error wraps the refused socket. A
    missing absolute path outside the work directory counts as a breach: the sandbox hides it."""
    for e in _chain(exc):
        if isinstance(e, MemoryError):
            return "sandbox_limit"
        if isinstance(e, BlockingIOError) and e.errno == errno.EAGAIN:  # fork past max_procs
            return "sandbox_limit"
        if isinstance(e, (socket.gaierror, ConnectionRefusedError)) or (
                isinstance(e, OSError) and e.errno in _NET_ERRNOS):
            return "sandbox_network"
        if type(e).__name__ in _NET_TYPES:
            return "sandbox_network"
        if isinstance(e, OSError) and e.errno in _FS_ERRNOS:
            return "sandbox_fs"
        if isinstance(e, FileNotFoundError) and e.filename is not None:
            name = os.fsdecode(e.filename)
            if os.path.isabs(name) and not under(name, workspace):
                return "sandbox_fs"
    return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
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


def _agent(ref: str) -> Any:
    module, _, name = ref.partition(":")
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def _type_names(t: type) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in t.__mro__ if c not in (object, BaseException)]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    workspace = os.getcwd()
    try:
        port = start_relay()
        base = f"http://127.0.0.1:{port}"
        rid = spec["rollout_id"]
        os.environ.update({"LIGHTNING_GATEWAY_URL": base, "LIGHTNING_ROLLOUT_ID": rid,
                           "OPENAI_BASE_URL": f"{base}/rollouts/{rid}/v1", "OPENAI_API_KEY": "sandboxed"})
        agent = _agent(spec["agent"])
        value = asyncio.run(agent(spec["task"])) if inspect.iscoroutinefunction(agent) else agent(spec["task"])
        json.dumps(value)  # a value that cannot travel back is the agent's error, said here
        return {"ok": True, "value": value}
    except BaseException as exc:  # noqa: BLE001 - every ending is reported, SystemExit included
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return {"ok": False, "error": text[:4000], "types": _type_names(type(exc)),
                "breach": classify(exc, workspace)}


def main() -> None:
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by path: this package's modules (jobs, tasks, cli) must not shadow the agent's
    spec = json.loads(sys.stdin.read())
    result = run(spec)
    data = json.dumps(result, default=str).encode()
    fd = int(spec["result_fd"])
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the relay thread and anything the agent left running end with the sandbox


if __name__ == "__main__":
    main()
