"""Agents for bench/bench_sandbox.py: the same work in a sandbox and in a plain worker process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any


def empty(task: dict[str, Any]) -> float:
    """Nothing: a rollout of it is all start-up and bookkeeping."""
    return 1.0


def run_code(task: dict[str, Any]) -> float:
    """What a coding agent's turn costs besides the LLM: write a program, run it with Python."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=".", delete=False) as f:
        f.write(f"print({task['n']} * 2)\n")
    try:
        out = subprocess.run([sys.executable, f.name], capture_output=True, text=True, timeout=60)
    finally:
        os.unlink(f.name)  # a plain worker's directory is the repository: leave nothing behind
    return 1.0 if out.stdout.strip() == str(task["n"] * 2) else 0.0
