"""A stand-in for the weight-swap surface of a vLLM server, for the trainer kill cells.

A real vLLM CPU server takes minutes to start and the suite shares one; these cells kill the
trainer at moments of a publish, which only needs the routes `WeightPublisher` calls
(trainer_backend/serving/publisher.py): /pause, /resume, /collective_rpc (lightning_checksum,
lightning_reload), /reset_prefix_cache, /update_weight_version, /weight_info. It serves them on
a real uvicorn socket, logs every call in order, and can hold one: the n-th call of a route
waits (the trainer blocked at that moment) until the test releases it, so the test kills
the trainer at a moment it observed, not at a guessed time. What it keeps is what a real
server would: the weights folder loaded last and the version tag.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


@dataclass
class Hold:
    """Hold the `nth` (1-based) call named `name`: `reached` is set when it arrives."""

    name: str
    nth: int
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class VLLMStandIn:
    def __init__(self) -> None:
        self.calls: list[str] = []  # route names in order, rpc calls as "rpc:<method>"
        self.loaded: str | None = None  # weights folder of the last lightning_reload
        self.version: str = "default"  # what a fresh vLLM reports
        self.hold: Hold | None = None
        self.swaps: list[tuple[str | None, str]] = []  # (weights folder, tag) of each completed tag call
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def count(self, name: str) -> int:
        return self.calls.count(name)

    async def _seen(self, name: str) -> None:
        self.calls.append(name)
        hold = self.hold
        if hold is not None and name == hold.name and self.count(name) == hold.nth:
            hold.reached.set()
            await asyncio.to_thread(hold.release.wait)

    def _app(self) -> Starlette:
        async def simple(request: Request) -> Any:
            await self._seen(request.url.path.strip("/"))
            return JSONResponse({"success": True})

        async def rpc(request: Request) -> Any:
            body = await request.json()
            method = body["method"]
            await self._seen(f"rpc:{method}")
            if method == "lightning_reload":
                self.loaded = body["kwargs"]["weights_path"]
                return JSONResponse({"results": [{"reload_s": 0.0, "repack_s": 0.0}]})
            return JSONResponse({"results": [{"checksum": float(self.count("rpc:lightning_reload"))}]})

        async def tag(request: Request) -> Any:
            self.version = str((await request.json())["new_version"])
            self.swaps.append((self.loaded, self.version))
            await self._seen("update_weight_version")
            return JSONResponse({})

        async def info(_request: Request) -> Any:
            await self._seen("weight_info")
            return JSONResponse({"weight_version": self.version})

        return Starlette(routes=[
            Route("/pause", simple, methods=["POST"]), Route("/resume", simple, methods=["POST"]),
            Route("/reset_prefix_cache", simple, methods=["POST"]), Route("/collective_rpc", rpc, methods=["POST"]),
            Route("/update_weight_version", tag, methods=["POST"]), Route("/weight_info", info, methods=["GET"]),
        ])

    def __enter__(self) -> VLLMStandIn:
        self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self.hold is not None:
            self.hold.release.set()
        self._server.should_exit = True
        self._thread.join(10)
