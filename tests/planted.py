"""Run pytest on a planted suite in a subprocess: how the tests of our pytest plugins see them work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What the outer run sets that would change the planted run's behaviour.
_OUTER = ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "LIGHTNING_TEST_LEAKS", "LIGHTNING_TEST_REQUIRE_ALL")


def run_pytest(folder: Path, *args: str, env: dict[str, str] | None = None,
               timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`pytest -q ARGS FOLDER` with no configuration file and only the plugins named in ARGS (loading
    every installed one costs each pytest process ~3 s of CPU), our modules importable."""
    full = {k: v for k, v in os.environ.items() if k not in _OUTER}
    full.update({"PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder),
                           "-c", os.devnull, *args, str(folder)],
                          capture_output=True, text=True, timeout=timeout, cwd=folder, env=full)
