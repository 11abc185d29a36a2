"""torch's OpenMP threads wait passively in a trainer process (trainer_backend/__init__.py): libgomp's
own report of its settings (OMP_DISPLAY_ENV) shows no spinning; a user's setting wins; the vLLM
server process does not inherit our default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def _gomp_spincount(code: str, **env: str) -> str:
    """GOMP_SPINCOUNT as libgomp reports it at load in a fresh process running `code`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    full.update(PYTHONPATH=str(ROOT), OMP_DISPLAY_ENV="VERBOSE", **env)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120,
                         check=True)
    spin = [line for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    assert spin, f"libgomp printed no settings:\n{out.stderr[-2000:]}"
    return spin[0].split("=", 1)[1].strip().strip("'")


def test_an_engine_import_makes_omp_threads_passive() -> None:
    assert _gomp_spincount("import trainer_backend.engines.torch_engine") == "0"


def test_torch_imported_first_keeps_libgomps_default() -> None:
    # what the default would be without us: the check above is not vacuous
    assert _gomp_spincount("import torch, trainer_backend") != "0"


def test_the_users_wait_policy_wins() -> None:
    assert _gomp_spincount("import trainer_backend.engines.torch_engine", OMP_WAIT_POLICY="ACTIVE") != "0"
    assert _gomp_spincount("import trainer_backend.engines.torch_engine", GOMP_SPINCOUNT="10000") == "10000"


def test_the_vllm_server_does_not_inherit_our_default(tmp_path: Path) -> None:
    code = ("import os, trainer_backend\nfrom pathlib import Path\nfrom trainer_backend.serving.env import server_env\n"
            "assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE'\n"
            f"print(server_env('cpu', 1, Path({str(tmp_path)!r})).get('OMP_WAIT_POLICY'))")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", code], env={**full, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "None"
    mine = subprocess.run([sys.executable, "-c", code.replace("PASSIVE", "ACTIVE")],
                          env={**full, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "ACTIVE"},
                          capture_output=True, text=True, timeout=120, check=True)
    assert mine.stdout.strip() == "ACTIVE"  # a user's own setting reaches the server
