"""The tiny model's warm start (trainer_backend/demo/warm_start.py): its SFT's learning-rate schedule
and the curve it keeps beside the model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer_backend.demo.warm_start import WarmStartConfig


def test_the_sft_warms_up_then_decays_and_keeps_its_curve(tmp_path: Path) -> None:
    """A real build, shrunk: the lr each step ran at is the shared schedule's (a warm-up, then a linear
    decay toward lr * min_lr_ratio), and warm_start.json keeps every step's lr and loss."""
    pytest.importorskip("transformers")
    from trainer_backend.demo.warm_start import warm_start
    from trainer_backend.engines.torch_config import schedule_factor

    cfg = WarmStartConfig(sft_steps=8, warmup_steps=2, demos=64, batch_size=4, precision="fp32", min_lr_ratio=0.1)
    out = warm_start(tmp_path / "ws", cfg, progress=False, threads=1)
    kept = json.loads((out / "warm_start.json").read_text())
    assert kept["lr_schedule"] == "linear" and kept["min_lr_ratio"] == 0.1 and kept["lr"] == cfg.lr
    curve = kept["curve"]
    want = [cfg.lr * schedule_factor(k, "linear", 2, 8, 0.1) for k in range(8)]
    assert curve["lr"] == pytest.approx(want)
    assert curve["lr"][:2] == pytest.approx([cfg.lr / 2, cfg.lr])  # the warm-up
    after = curve["lr"][2:]  # from the peak down
    assert all(a > b for a, b in zip(after, after[1:])) and after[-1] > 0.1 * cfg.lr  # decaying, not yet at the floor
    assert len(curve["loss"]) == 8 and all(math.isfinite(x) and x > 0 for x in curve["loss"])
    assert curve["loss"][-1] < curve["loss"][0]


def test_a_schedule_is_part_of_the_cache_key_and_a_bad_one_is_refused() -> None:
    """A build at another schedule never reuses a cached one; an unknown schedule fails in one line
    before anything is built."""
    pytest.importorskip("torch")
    assert WarmStartConfig().key() != WarmStartConfig(lr_schedule="constant").key()
    assert WarmStartConfig().key() != WarmStartConfig(min_lr_ratio=0.5).key()
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, linear, cosine, not 'step'"):
        WarmStartConfig(lr_schedule="step").resolved()
