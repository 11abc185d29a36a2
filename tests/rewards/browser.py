"""A real headless Chromium driven over the DevTools protocol (the `websockets` client that
uvicorn[standard] brings; no browser download, no driver binary), and an ASGI app served on
loopback by uvicorn in a thread: what the labelling page's test clicks through.

Chromium is Debian's package (`scripts/setup.sh` installs it); without it the browser test
fails and says so, as the PostgreSQL tests do without PostgreSQL.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from websockets.sync.client import connect

from lightning_middleware.testing import free_port

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,900"]


# Chromium's start to an open DevTools port: 0.6-1.8 s on a 2-core AVX2 EPYC at load 2.2.
QUIET_START_S = 2.0


def chromium_binary() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    """One page of a headless Chromium; `evaluate` runs JavaScript in it and returns the value."""

    def __init__(self, binary: str, profile: Path) -> None:
        port = free_port()
        self._proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}",
                                       f"--remote-debugging-port={port}", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._ids = itertools.count(1)
        started = time.monotonic()
        deadline = started + 30
        while True:
            try:
                pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                         if t.get("type") == "page"]
                if pages:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self.close()
                raise RuntimeError(f"chromium did not open its DevTools port {port}")
            time.sleep(0.2)
        self._ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024)
        # How much slower than usual this machine is right now, read off Chromium's own start: the
        # page's waits are scaled by it, so a loaded machine gets the same margin, not a flake.
        self.slowness = max(1.0, (time.monotonic() - started) / QUIET_START_S)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv(timeout=30))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Poll `expression` until it is truthy; `timeout` is for a machine as fast as usual. An
        expression that throws (an element not there while the page re-renders) is polled again:
        at the deadline the last error is raised."""
        deadline = time.monotonic() + timeout * self.slowness
        while True:
            try:
                value, error = self.evaluate(expression), None
            except RuntimeError as exc:  # the page script threw
                value, error = None, exc
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never had {expression}") from error
            time.sleep(0.1)

    def click(self, selector: str) -> None:
        if not self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                             "if (!e) return false; e.click(); return true; })()"):
            raise LookupError(f"nothing on the page matches {selector}")

    def type(self, selector: str, text: str) -> None:
        self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                      f"e.value = {json.dumps(text)}; e.dispatchEvent(new Event('change')); }})()")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


@contextmanager
def browser(profile: Path) -> Iterator[Browser]:
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("no Chromium for the browser test: run scripts/setup.sh (or apt-get install chromium)")
    b = Browser(binary, profile)
    try:
        yield b
    finally:
        b.close()


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """`app` on 127.0.0.1 (uvicorn, in a thread); yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the app did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
