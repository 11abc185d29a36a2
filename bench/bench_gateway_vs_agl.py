"""Our gateway against the reference implementation's (agentlightning 1.0.2 from PyPI), in one run.

    python bench/bench_gateway_vs_agl.py [--python PYTHON3.12] [bench_gateway.py's options]

Builds (once) a virtual environment with agentlightning from PyPI, from a Python >= 3.12 (its
`Requires-Python`; found on PATH or under pyenv when `--python` is not given), then runs
`bench/bench_gateway.py` with that environment's gateway as one more target, at 32 and 256
concurrent callers unless `--conc` says otherwise. Everything else is bench_gateway.py's.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGL_REQUIREMENT = "agentlightning==1.0.2"
ENV_DIR = os.path.join(os.path.expanduser("~"), ".cache", "lightning-middleware", "agl-env")


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]), int(out[1])


def find_python() -> str | None:
    """A Python >= 3.12 on this machine: PATH first, then pyenv's versions."""
    candidates = [shutil.which(f"python3.{minor}") for minor in (12, 13, 14)]
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", "3.1[2-9]*", "bin", "python3")))
    for python in candidates:
        if python and (_version(python) or (0, 0)) >= (3, 12):
            return python
    return None


def ensure_env(python: str) -> str:
    """The environment's interpreter, with the reference installed (created on first use)."""
    env_python = os.path.join(ENV_DIR, "bin", "python")
    probe = [env_python, "-c", f"import importlib.metadata as m; assert m.version('agentlightning') == "
             f"{AGL_REQUIREMENT.split('==')[1]!r}"]
    if os.path.exists(env_python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return env_python
    shutil.rmtree(ENV_DIR, ignore_errors=True)
    subprocess.run([python, "-m", "venv", ENV_DIR], check=True)
    subprocess.run([env_python, "-m", "pip", "install", "-q", AGL_REQUIREMENT], check=True)
    subprocess.run(probe, check=True)
    return env_python


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--python", default=None, help="a Python >= 3.12 to build the reference's environment from")
    args, rest = ap.parse_known_args()
    python = args.python or find_python()
    if python is None or (_version(python) or (0, 0)) < (3, 12):
        print(f"{AGL_REQUIREMENT} needs Python >= 3.12: none found on PATH or under pyenv; give one with --python",
              file=sys.stderr)
        return 2
    env_python = ensure_env(python)
    if not any(a == "--conc" or a.startswith("--conc=") for a in rest):
        rest += ["--conc", "32,256"]
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_gateway.py"),
                           "--agl-python", env_python, *rest]).returncode


if __name__ == "__main__":
    sys.exit(main())
