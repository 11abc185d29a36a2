"""Run one of the verl CPU helpers (verl_cpu_actor.py, verl_cpu_lora.py, verl_cpu_policies.py) in its own
process: they change process globals (a CPU platform, a gloo process group on a free port)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def run_verl_helper(name: str, args: list[str], timeout: float) -> None:
    """Run tests/trainer/`name` with `args`; a failure shows the end of its stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    helper = Path(__file__).with_name(name)
    proc = subprocess.run([sys.executable, str(helper), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "VERL_CPU_PORT": str(port)})
    assert proc.returncode == 0, proc.stderr[-4000:]
