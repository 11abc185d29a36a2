"""The fault matrix's bookkeeping: each test measures one cell and reports it here.

A cell's figures (docs/reliability.md): calls the agent sent, calls the store holds, calls the
agent had answered that the store does not hold (lost), rollouts trained twice, and how long the
system took to be whole again. Each test asserts on them; `report()` also logs them and, with
LIGHTNING_FAULT_REPORT=path, appends them as one JSON line, which is how the table was filled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cell:
    name: str
    sent: int
    recorded: int
    lost: int
    trained_twice: int = 0
    recovery_s: float | None = None
    note: str = ""


def report(cell: Cell) -> Cell:
    log.warning("fault cell %s", cell)
    path = os.environ.get("LIGHTNING_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(dataclasses.asdict(cell)) + "\n")
    return cell


def kill9(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """SIGKILL the process group the child leads (started with start_new_session=True)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def wait_for(what: str, check: Callable[[], object], timeout: float = 60.0, every: float = 0.02) -> float:
    """Poll `check` until it is truthy; returns the seconds it took (fails the test on timeout)."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - t0
