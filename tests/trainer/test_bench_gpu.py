"""bench/bench_gpu.py is run on a lent GPU with one try of a few minutes, so its whole path runs
here first, on CPU with a tiny Qwen2 shape: the stored real rows load, both modes train, and the
figures it reports follow from what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from trainer_backend.engines.precision import bf16_probe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_both_modes_on_the_stored_rows(tmp_path: Path) -> None:
    native = bf16_probe().native  # emulated bf16 (AVX2) trains this tiny model ~60x slower than fp32
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "run", "--device", "cpu", "--models", "tiny",
           "--batch", "3", "--steps", "1", "--precision", "bf16" if native else "fp32", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, cwd=ROOT)
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / "smol-rows.jsonl").read_text().splitlines()]
    assert len(rows) >= 32 and all(sum(r["loss_mask"]) > 0 for r in rows)  # real rows: prompts and completions
    assert [(c["model"], c["mode"]) for c in result["cells"]] == [("tiny", "full"), ("tiny", "lora")]
    for cell in result["cells"]:
        assert "error" not in cell, cell
        assert cell["tokens"] == sum(len(r["input_ids"]) for r in rows[:3])
        assert cell["trained"] == sum(sum(r["loss_mask"]) for r in rows[:3])
        assert cell["tokens_per_s"] == pytest.approx(cell["tokens"] / cell["step_s"])
        assert cell["mfu"] > 0
        if native:  # against the bf16 peak, an fp32 step on a CPU that emulates bf16 can pass 1
            assert cell["mfu"] < 1, cell
