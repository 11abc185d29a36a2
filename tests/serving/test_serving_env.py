"""Fast checks of the launcher's environment handling (no vLLM server needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_backend.serving import env as serving
from trainer_backend.serving.publisher import PublishError, WeightPublisher, server_root
from trainer_backend.serving.server import VLLMServer, VLLMServerError


def test_core_modules_import_no_heavy_packages() -> None:
    code = (
        "import sys, trainer_backend.serving.server, trainer_backend.serving.publisher;"
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_device_detection_honours_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_VLLM_DEVICE", "cuda")
    assert serving.detect_device() == "cuda"
    assert serving.detect_device("cpu") == "cpu"
    monkeypatch.setenv("LIGHTNING_VLLM_DEVICE", "tpu")
    with pytest.raises(ValueError):
        serving.detect_device()
    monkeypatch.delenv("LIGHTNING_VLLM_DEVICE")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    assert serving.detect_device() == "cpu"


def test_env_locations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LIGHTNING_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("LIGHTNING_HOME", str(tmp_path))
    assert serving.vllm_python() == tmp_path / "vllm-env" / "bin" / "python"
    monkeypatch.setenv("LIGHTNING_VLLM_PYTHON", "/opt/x/bin/python")
    assert serving.vllm_python() == Path("/opt/x/bin/python")
    assert serving.ensure_vllm_env() == Path("/opt/x/bin/python")  # used as is, nothing installed


def test_server_pythonpath_exposes_only_trainer_backend(tmp_path: Path) -> None:
    path = serving.make_server_pythonpath(tmp_path / "p")
    assert [p.name for p in path.iterdir()] == ["trainer_backend"]
    assert (path / "trainer_backend" / "serving" / "worker_extension.py").exists()
    env = serving.server_env("cpu", 2, path)
    assert env["PYTHONPATH"].split(":")[0] == str(path)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_server_command_and_urls(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path, python=sys.executable, extra_args=["--seed", "3"], device="cpu")
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--enable-auto-tool-choice", "--worker-extension-cls",
                 "--enable-scale-out", "--enable-prompt-tokens-details"):  # the token-in scoring route
        assert flag in cmd
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    smol = VLLMServer(tmp_path, python=sys.executable, device="cpu", tool_parser="xlam").command()
    assert smol[smol.index("--tool-call-parser") + 1] == "xlam"  # SmolLM2's <tool_call>[...] lists
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"  # the sampled distribution's
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"  # API defaults, not the model's
    assert cmd[-2:] == ["--seed", "3"]
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    with socket.socket() as sock:  # the chosen port was free
        sock.bind(("127.0.0.1", server.port))


def test_missing_vllm_python_is_a_clear_error(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path, python=tmp_path / "nope" / "python")
    with pytest.raises(VLLMServerError, match="ensure_vllm_env"):
        server.start()


def test_publisher_url_and_precheck(tmp_path: Path) -> None:
    assert server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://h:1") == "http://h:1"
    # An unreachable server is never contacted for a folder without weights.
    with pytest.raises(PublishError, match="safetensors"):
        WeightPublisher("http://127.0.0.1:9/v1").publish(tmp_path, "x")
    # "abort" would lose the work in flight: refused in one line that names the modes
    with pytest.raises(ValueError, match=r"^pause must be one of wait, keep, not 'abort'$"):
        WeightPublisher("http://127.0.0.1:9/v1", pause="abort")  # type: ignore[arg-type]


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    from trainer_backend.serving.server import VLLMServer, VLLMServerError

    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 1\n")  # never reached: the port check comes first
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = VLLMServer(tmp_path, port=port, python=fake_python)
        with pytest.raises(VLLMServerError, match=f"port {port} on 127.0.0.1 is in use"):
            server.start()
