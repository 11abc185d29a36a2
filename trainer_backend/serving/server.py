"""Run a vLLM OpenAI-compatible server for a model folder, from its own environment (env.py).

Stdlib and httpx only: this module never imports torch, transformers or vllm.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from trainer_backend.caching import lightning_home
from trainer_backend.serving.env import (
    WORKER_EXTENSION,
    VLLMServerError,
    detect_device,
    make_server_pythonpath,
    server_env,
    vllm_python,
)

log = logging.getLogger(__name__)
# vLLM's CPU backend binds its model threads to the cores this names ("auto": all but one per rank)
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# Runs beside the server (plain python, no imports beyond stdlib): if the process
# that launched the server dies without stop() (SIGKILL, crash), the server would
# live on in its own session; this ends it. Exits by itself once the server is gone.
_WATCHDOG = """
import os, signal, sys, time
parent, pgid = int(sys.argv[1]), int(sys.argv[2])
while True:
    time.sleep(1.0)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(0)
    if os.getppid() != parent:
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                sys.exit(0)
            time.sleep(wait)
        sys.exit(0)
"""


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
        watchdog: bool = True,
        max_lora_rank: int | None = None,
        max_loras: int = 4,
        tool_parser: str = "hermes",
        all_cores: bool = False,
    ) -> None:
        """`max_lora_rank`: serve LoRA adapters up to this rank, loaded at run time by name
        (`WeightPublisher(adapter_name=...)`), at most `max_loras` of them in one batch.
        `tool_parser`: vLLM's `--tool-call-parser` for the model's tool-call format (hermes for
        `<tool_call>{...}</tool_call>`; xlam for SmolLM2's `<tool_call>[{...}]</tool_call>` lists).
        `all_cores` (CPU): one model thread on every core this process may use; by default vLLM keeps
        one core for its scheduler, which on 2 idle cores leaves the model one thread (1.56x slower
        evaluations on 2 AVX2 cores; beside a busy process, two were slower: docs/benchmarks.md).
        `set_threads` then changes the count while it serves."""
        self.model_dir = Path(model_dir).expanduser().resolve()
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
        self.watchdog = watchdog
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.tool_parser = tool_parser
        self.all_cores = all_cores
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
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
            "--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser,
            "--worker-extension-cls", WORKER_EXTENSION,
            # Log-probs of the distribution each token was sampled from (after temperature and
            # top-k/top-p), the behaviour policy the trainer's ratio compares with; and the API's
            # sampling defaults, not the model's generation_config, so that a request without a
            # temperature was sampled at 1 as the trainer assumes (lightning_middleware/rows.py).
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            # The token-in endpoint (/inference/v1/generate) takes any SamplingParams, among them
            # prompt log-probs that read the prefix cache (the OpenAI routes recompute every prompt),
            # and usage then says how many prompt tokens the cache held.
            "--enable-scale-out", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.max_lora_rank:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        return cmd + list(self.extra_args)

    def environment(self, pythonpath: Path) -> dict[str, str]:
        """The server process's environment (`env` given to the constructor wins)."""
        env = server_env(self.device, self.kv_cache_gib, pythonpath)
        if self.max_lora_rank:  # /v1/load_lora_adapter: the trainer hot-loads each new adapter version
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.all_cores and self.device == "cpu":
            env[CPU_BIND] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        env.update(self.extra_env)
        return env

    def start(self) -> VLLMServer:
        """Start the process and wait until ``/health`` answers 200."""
        if self._proc is not None:
            raise VLLMServerError("server already started")
        if not self.python.exists():
            raise VLLMServerError(
                f"no vLLM python at {self.python}; run ensure_vllm_env() "
                "(`lightning-mw vllm-env`) or set LIGHTNING_VLLM_PYTHON"
            )
        _check_port_free(self.host, self.port)
        self._tmp = tempfile.TemporaryDirectory(prefix="lightning-vllm-")
        pypath = make_server_pythonpath(Path(self._tmp.name) / "path")
        env = self.environment(pypath)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM on %s for %s (log %s)", self.url, self.model_dir, self.log_path)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as logf:
            # cwd: `python -m` puts the working directory first on sys.path, so a
            # checkout with another trainer_backend/ there would shadow ours.
            self._proc = subprocess.Popen(
                self.command(), stdout=logf, stderr=subprocess.STDOUT, env=env,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self._tmp.name,
            )  # fmt: skip
        if self.watchdog:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self._proc.pid)],
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
                    reason = f"vLLM exited with code {code} during startup"
                    raise VLLMServerError(f"{reason}; log tail ({self.log_path}):\n{self.log_tail()}",
                                          reason=reason)
                if time.monotonic() - t0 > self.startup_timeout:
                    reason = f"vLLM not healthy after {self.startup_timeout:.0f} s"
                    raise VLLMServerError(f"{reason}; log tail ({self.log_path}):\n{self.log_tail()}",
                                          reason=reason)
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)

    def set_threads(self, threads: int, timeout: float = 60.0) -> int:
        """How many threads the model computes on from now on (CPU; 0: unchanged); returns the worker's
        count. Above one only where `all_cores` bound the threads to more than one core at start."""
        if threads < 0:
            raise ValueError(f"threads must be 0 or more, not {threads}")
        try:
            r = httpx.post(f"{self.url}/collective_rpc", timeout=timeout,
                           json={"method": "lightning_threads", "kwargs": {"threads": threads}})
            r.raise_for_status()
            result = r.json()["results"][0]
            if "error" in result:
                raise ValueError(result["error"])
            return int(result["threads"])
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise VLLMServerError(f"could not set the server's threads to {threads}: {exc}") from None

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
        dog, self._watchdog = self._watchdog, None
        if dog is not None:  # it exits within a second of the server group
            try:
                dog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                dog.kill()
                dog.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_port_free(host: str, port: int) -> None:
    """Fail in a second with a plain message, not after vLLM's minute of loading."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise VLLMServerError(f"port {port} on {host} is in use ({exc.strerror}); pick another "
                                  "or leave port=None for a free one") from None


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
