"""The sandboxed backend: each rollout a fresh process under bubblewrap (controller/sandbox.py),
reaching the LLM only through the gateway, by a door that lets out its own rollout's routes.

    backend = SandboxedBackend("http://127.0.0.1:8100", token=..., sandbox=Sandbox(max_procs=32))
    RolloutController("mypkg.agent:run", store=url, backend=backend).run(tasks, n=8)

A sandboxed rollout cannot open the store, so the gateway records it: the backend creates the
rollout there, the agent's client reaches it as `OPENAI_BASE_URL` (its calls are recorded with
token IDs, as any gateway call), and the backend finishes it there. The agent's return value is
its reward, posted by the backend unless the reward configuration refuses the rollout's own
rewards (the gateway says so; nothing is stored then).

The door is a small ASGI app served by uvicorn on a Unix socket bound into the sandbox. It holds
the gateway's token, which never enters the sandbox, and passes on only
`/rollouts/{id}/v1/...`, `GET /rollouts/{id}` and `POST /rollouts/{id}/reward`, for the rollout's
own id. Anything else is refused with a 403 and recorded as that rollout's `sandbox_network`
breach; a reward the gateway refuses is its `sandbox_reward` breach. A breach ends the rollout
failed with its class, a store event of kind `sandbox_breach`, and no retry.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from lightning_middleware.controller.backends.gateway_rollouts import GatewayRollouts
from lightning_middleware.controller.execution import AgentFn
from lightning_middleware.controller.jobs import (
    BREACHES,
    RolloutJob,
    RolloutOutcome,
    SandboxBreach,
    SandboxLimit,
    SandboxNetwork,
    SandboxReward,
)
from lightning_middleware.controller.sandbox import (
    PidsCgroup,
    Sandbox,
    SandboxUnavailable,
    bwrap_command,
    check_host,
    limits_prefix,
    pids_limit_available,
)
from lightning_middleware.controller.sandbox_entry import ENV_SANDBOX, ENV_SANDBOX_WORKSPACE
from lightning_middleware.errors import UsageError
from lightning_middleware.records import SANDBOX_BREACH, Event, RolloutStatus
from lightning_middleware.store import TraceStore
from lightning_middleware.store.connect import sqlite_file

log = logging.getLogger(__name__)
_HOP = {b"host", b"authorization", b"connection", b"keep-alive", b"transfer-encoding", b"content-length",
        b"proxy-authorization", b"upgrade", b"te"}  # not passed on to the gateway
_HOP_BACK = _HOP - {b"content-length"}  # not passed back to the sandbox
_MAX_BODY = 64 * 2**20


class Door:
    """One rollout's way out: an ASGI app that forwards the rollout's own gateway routes, with the
    gateway's token, and refuses the rest."""

    def __init__(self, rollout_id: str, gateway_url: str, token: str | None) -> None:
        self.rid = rollout_id
        self.gateway_url = gateway_url.rstrip("/")
        self.token = token
        self.gateway = GatewayRollouts(self.gateway_url, token)
        self.client: httpx.AsyncClient | None = None  # made in the door's own event loop (lifespan)
        self.breaches: list[tuple[type[SandboxBreach], str]] = []  # what it refused, first first

    def allows(self, method: str, path: str) -> bool:
        own = f"/rollouts/{self.rid}"
        return (path.startswith(own + "/v1/") or (path == own and method == "GET")
                or (path == own + "/reward" and method == "POST"))

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        assert self.client is not None
        method, path = scope["method"], scope["path"]
        if not self.allows(method, path):
            self.breaches.append((SandboxNetwork, f"{method} {path} through the gateway door"))
            await _reply(send, 403, {"error": {"message": f"a sandboxed rollout may use only its own routes "
                                                          f"(/rollouts/{self.rid}/...)",
                                               "type": "permission_error", "code": "sandbox_route"}})
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > _MAX_BODY:
                await _reply(send, 413, {"error": {"message": "request body too large", "code": "too_large"}})
                return
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        if self.token:
            headers.append((b"authorization", f"Bearer {self.token}".encode()))
        query = scope.get("query_string", b"").decode()
        url = self.gateway_url + path + (f"?{query}" if query else "")
        try:
            request = self.client.build_request(method, url, headers=headers, content=bytes(body))
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            await _reply(send, 502, {"error": {"message": f"the gateway is unreachable: {exc}",
                                               "code": "gateway_unreachable"}})
            return
        try:
            if response.status_code == 403 and path.endswith("/reward"):
                raw = await response.aread()
                if b"reward_refused" in raw:
                    self.breaches.append((SandboxReward, "POST /reward refused by the reward configuration"))
                await send({"type": "http.response.start", "status": 403, "headers": _out_headers(response)})
                await send({"type": "http.response.body", "body": raw})
                return
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": _out_headers(response)})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


def _out_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BACK]


async def _reply(send: Any, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _DoorServer:
    """uvicorn serving one Door on a Unix socket, in a thread of its own (as the gateway's server
    runs): off the main thread uvicorn leaves the controller's signal handlers alone."""

    def __init__(self, door: Door, path: str) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)  # the sandbox's user maps to ours; nobody else may knock
        config = uvicorn.Config(door, lifespan="on", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"lightning-door-{door.rid[:12]}", daemon=True)

    async def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the sandbox's door to the gateway did not start")
            await asyncio.sleep(0.002)

    def stop(self) -> None:
        """Ask the server to stop, without waiting: uvicorn looks every 0.1 s, and the rollout, whose
        sandbox is gone, need not wait for it (`join` does, at the backend's close)."""
        self.server.should_exit = True

    def join(self) -> None:
        if self.thread.is_alive():
            self.thread.join(10)
        self.sock.close()


class SandboxedBackend:
    """Rollouts in bubblewrap sandboxes, one process each, at most `workers` at once."""

    name = "sandbox"
    out_of_process = True

    def __init__(self, gateway_url: str, *, token: str | None = None, sandbox: Sandbox | None = None,
                 workers: int | None = None, env: dict[str, str] | None = None, python: str | None = None,
                 python_path: list[str] | None = None, root: str | None = None) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.token = token
        self.gateway = GatewayRollouts(self.gateway_url, token)
        self.sandbox = sandbox or Sandbox()
        self.workers = workers or os.cpu_count() or 2
        self.env = dict(env or {})
        self.python = python or sys.executable
        self.python_path = python_path if python_path is not None else [p for p in sys.path if p]
        self.root_dir = root  # where the work directories and doors live; None: a fresh temporary one
        self._free: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._root: str | None = None
        self._blind = "/dev/null"
        self._doors = ""
        self._stopping: list[_DoorServer] = []
        self.store: TraceStore | None = None
        self.agent_ref = ""

    # -- the Backend seam ------------------------------------------------------------------------

    def start(self, agent: AgentFn | str, store: TraceStore) -> None:
        self.bwrap = check_host()
        if self.sandbox.max_procs is not None and not pids_limit_available():
            raise SandboxUnavailable("max_procs cannot be enforced here: the controller runs as root and no "
                                     "cgroup pids controller is writable (set max_procs=None to run without it)")
        if callable(agent):
            module, name = getattr(agent, "__module__", None), getattr(agent, "__qualname__", "")
            if not module or "<" in name:
                raise UsageError("a sandboxed agent is a module-level function or 'module:function'")
            agent = f"{module}:{name}"
        self.agent_ref = agent
        self.store = store
        if self.root_dir is not None:
            os.makedirs(self.root_dir, exist_ok=True)
        self._root = tempfile.mkdtemp(prefix="lightning-sandbox-", dir=self.root_dir)
        self._doors = tempfile.mkdtemp(prefix="lm-doors-")  # short: a socket's path is at most 107 bytes
        os.makedirs(os.path.join(self._root, "work"))
        self._blind = os.path.join(self._root, "masked")  # what a masked file shows: mode 000, so reads fail
        with open(self._blind, "w"):
            pass
        os.chmod(self._blind, 0)

    async def run(self, job: RolloutJob) -> RolloutOutcome:
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:
            self._free, self._loop = asyncio.Semaphore(self.workers), loop
        if job.rewards is not None:
            raise UsageError("a sandboxed rollout is scored by the gateway's reward configuration "
                             "(lightning-mw gateway --rewards); leave the controller's rewards unset")
        async with self._free:
            return await self._run(job)

    def close(self) -> None:
        for door in self._stopping:
            door.join()
        self._stopping = []
        self.gateway.close()
        for d in (self._root, self._doors):
            if d:
                shutil.rmtree(d, ignore_errors=True)

    # -- one rollout -----------------------------------------------------------------------------

    async def _run(self, job: RolloutJob) -> RolloutOutcome:
        assert self._root is not None
        t0 = time.monotonic()
        rid = job.rollout_id
        refused = await self.gateway.create(job, t0, "sandbox")
        if refused is not None:  # infrastructure: retried by the policy, ended by the controller
            return refused
        work = os.path.join(self._root, "work", rid)
        door = Door(rid, self.gateway_url, self.token)
        door_path = os.path.join(self._doors, hashlib.sha1(rid.encode()).hexdigest()[:16] + ".sock")
        server = _DoorServer(door, door_path)
        cgroup: PidsCgroup | None = None
        try:
            self._make_workspace(work)
            await server.start()
            if self.sandbox.max_procs is not None and os.getuid() == 0:
                cgroup = PidsCgroup.create(f"r-{rid[:60]}", self.sandbox.max_procs)
            status, error, breach, value = await self._sandboxed(job, work, door_path, cgroup)
        finally:
            server.stop()
            for done in [d for d in self._stopping if not d.thread.is_alive()]:
                done.join()  # closes its socket
                self._stopping.remove(done)
            self._stopping.append(server)
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)
            shutil.rmtree(work, ignore_errors=True)
            try:
                os.unlink(door_path)
            except FileNotFoundError:
                pass
        if door.breaches:  # what the door saw is authoritative: the agent may have caught its error
            kind, detail = door.breaches[0]
            status, error, breach = RolloutStatus.FAILED.value, f"{kind.kind}: {detail}", kind
        if breach is not None:
            await asyncio.to_thread(self._record_breach, rid, breach, error or "")
        return await self.gateway.finish(job, t0, status, error, breach, value, "sandbox")

    def _make_workspace(self, work: str) -> None:
        src = self.sandbox.workspace_from
        if src:
            ignore = shutil.ignore_patterns(".git") if self.sandbox.hide_git else None
            shutil.copytree(src, work, ignore=ignore, symlinks=True)
        else:
            os.makedirs(work)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in self.sandbox.env_allow}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env.update(self.env)
        ws = self.sandbox.workspace_path
        env.update({"HOME": ws, "TMPDIR": ws, "PYTHONPATH": os.pathsep.join(self.python_path),
                    "PYTHONDONTWRITEBYTECODE": "1", ENV_SANDBOX: "1", ENV_SANDBOX_WORKSPACE: ws})
        if self.sandbox.hide_git:
            env["GIT_DIR"] = "/dev/null/no-git"
        return env

    def _masked(self) -> list[str]:
        out = list(self.sandbox.hidden_paths)
        path = sqlite_file(self.store.url) if self.store is not None else None
        if path:
            out += [path + suffix for suffix in ("", "-wal", "-shm", "-journal")]
        assert self._root is not None
        return [*out, self._root, self._doors]

    async def _sandboxed(self, job: RolloutJob, work: str, door_path: str, cgroup: PidsCgroup | None
                         ) -> tuple[str, str | None, type[SandboxBreach] | None, Any]:
        """(status, error, breach, the agent's return value) of one sandboxed run."""
        r, w = os.pipe()
        cmd = limits_prefix(self.sandbox) + bwrap_command(
            self.sandbox, bwrap=self.bwrap, workspace_dir=work, door_socket=door_path, python=self.python,
            python_path=self.python_path, env=self._env(), masked=self._masked(), blind_file=self._blind)
        if cgroup is not None:
            cmd = cgroup.enter_command(cmd)
        spec = {"agent": self.agent_ref, "task": job.task, "rollout_id": job.rollout_id, "result_fd": w}
        log_path = work + ".log"
        with open(log_path, "wb") as out:
            try:
                proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=out,
                                                            stderr=out, pass_fds=(w,), start_new_session=True)
            finally:
                os.close(w)
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(spec, default=str).encode())
            await proc.stdin.drain()
            proc.stdin.close()
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), job.timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
            finally:
                if proc.returncode is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # bwrap is PID 1 of the sandbox: all inside die
                    except ProcessLookupError:
                        pass
                    await proc.wait()
            raw = _read_all(r)
        finally:
            os.close(r)
        tail = _tail(log_path)
        if timed_out:
            return (RolloutStatus.TIMEOUT.value, f"sandbox_limit: ran past its {job.timeout_s:g}s deadline",
                    SandboxLimit, None)
        try:
            result = json.loads(raw) if raw else None
        except ValueError:
            result = None
        if result is None:
            code = proc.returncode
            if code in (128 + signal.SIGKILL, 128 + signal.SIGXCPU, -signal.SIGKILL, -signal.SIGXCPU):
                return (RolloutStatus.FAILED.value, f"sandbox_limit: killed by the kernel (exit {code}, CPU time "
                        f"or memory limit){tail}", SandboxLimit, None)
            return RolloutStatus.FAILED.value, f"the sandboxed agent exited with code {code}{tail}", None, None
        if result["ok"]:
            return RolloutStatus.SUCCEEDED.value, None, None, result.get("value")
        breach = BREACHES.get(result.get("breach") or "")  # kinds as sandbox_entry.BREACH_KINDS names them
        error = result["error"] if breach is None else f"{breach.kind}: {result['error']}"
        status = RolloutStatus.FAILED.value
        if breach is None and "builtins.TimeoutError" in result.get("types", []):
            status = RolloutStatus.TIMEOUT.value
        return status, error, breach, None

    def _record_breach(self, rid: str, breach: type[SandboxBreach], error: str) -> None:
        assert self.store is not None
        self.store.add_event(Event(kind=SANDBOX_BREACH, source="sandbox", message=error[:500],
                                   data={"rollout_id": rid, "class": breach.kind}))


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                break
            raise
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def _tail(path: str, limit: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            text = f.read().decode(errors="replace").strip()
        os.unlink(path)
    except OSError:
        return ""
    return f"; its last output: {text}" if text else ""
