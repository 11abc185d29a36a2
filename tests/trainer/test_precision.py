"""The compute precision follows what the CPU really does: bf16 only where it is native and faster.

Both branches are tested on any machine by forcing the probe's answer (LIGHTNING_BF16, or a
BF16Probe passed in); the real probe is run once and must agree with torch's own capability check.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.trainer.tiny_models import save_tiny_qwen2  # noqa: E402
from trainer_backend.demo.warm_start import WarmStartConfig  # noqa: E402
from trainer_backend.engines.precision import (  # noqa: E402
    MIN_SPEEDUP,
    BF16Probe,
    autocast_dtype,
    bf16_probe,
    cpu_kind,
    resolve_precision,
)
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

NATIVE = BF16Probe("cpu", True, "test: native", bf16_gflops=200.0, fp32_gflops=100.0)
EMULATED = BF16Probe("cpu", False, "test: emulated", bf16_gflops=1.3, fp32_gflops=81.5)


def test_auto_picks_bf16_only_where_native() -> None:
    assert resolve_precision("auto", probe=NATIVE) == "bf16"
    assert resolve_precision(None, probe=NATIVE, bf16_name="bf16-autocast") == "bf16-autocast"
    assert resolve_precision("auto", probe=EMULATED) == "fp32"
    assert autocast_dtype(probe=NATIVE) == "bfloat16" and autocast_dtype(probe=EMULATED) is None
    assert resolve_precision("fp32", probe=NATIVE) == "fp32"  # an explicit choice is kept


def test_explicit_bf16_without_native_bf16_warns_with_its_cost(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_backend.engines.precision"):
        assert resolve_precision("bf16", probe=EMULATED) == "bf16"  # honoured: the user asked
    assert "63x slower than fp32" in caplog.text and "'auto' or 'fp32' would be faster" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer_backend.engines.precision"):
        resolve_precision("bf16-autocast", probe=NATIVE)
    assert caplog.text == ""


def test_the_environment_forces_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_BF16", "0")
    assert not bf16_probe().native and resolve_precision("auto") == "fp32"
    monkeypatch.setenv("LIGHTNING_BF16", "1")
    assert bf16_probe().native and resolve_precision("auto") == "bf16"


def test_the_engine_and_the_warm_start_follow_the_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = save_tiny_qwen2(tmp_path / "m", vocab=64)
    keys = {}
    for forced, want in (("0", "fp32"), ("1", "bf16")):
        monkeypatch.setenv("LIGHTNING_BF16", forced)
        eng = TorchEngine(model, TorchEngineConfig())  # default precision: auto
        assert eng.config.precision == want
        assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16 if want == "bf16" else torch.float32}
        ws = WarmStartConfig().resolved()
        assert ws.precision == want
        keys[want] = ws.key()
    assert keys["fp32"] != keys["bf16"]  # caches of the two CPU kinds never mix
    with pytest.raises(ValueError, match="warm-start precision"):
        WarmStartConfig(precision="fp16").resolved()


def test_the_real_probe_agrees_with_torch_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_BF16", raising=False)
    probe = bf16_probe(cache_dir=tmp_path)
    assert probe.fp32_gflops and probe.fp32_gflops > 1 and probe.bf16_gflops and probe.bf16_gflops > 0
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert probe.native == (probe.bf16_gflops >= MIN_SPEEDUP * probe.fp32_gflops)
    else:
        assert not probe.native  # no oneDNN bf16 kernels: never bf16, however the timing came out
    [cached] = tmp_path.glob("bf16-probe-*.json")
    assert json.loads(cached.read_text())["native"] == probe.native
    assert bf16_probe(cache_dir=tmp_path) == probe  # read back, not measured again
    assert cpu_kind()


def test_an_isa_limit_is_its_own_cache_entry_and_answers_fp32(tmp_path: Path) -> None:
    """Restricting oneDNN and ATen to AVX2 (as on an AVX2-only CPU) makes bf16 emulated: the probe,
    in a fresh process with its own cache entry, says fp32."""
    code = ("import json; from dataclasses import asdict; from trainer_backend.engines.precision import bf16_probe;"
            f"print(json.dumps(asdict(bf16_probe(cache_dir={str(tmp_path)!r}))))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    env.pop("LIGHTNING_BF16", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["native"] is False and probe["capability"] == "AVX2"
    assert probe["bf16_gflops"] < probe["fp32_gflops"]
    assert len(list(tmp_path.glob("bf16-probe-*.json"))) == 1
