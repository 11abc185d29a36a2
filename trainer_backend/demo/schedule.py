"""The demo's learning-rate schedule over its RL budget (minutes, or steps with --max-steps)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run.py imports this module
    from trainer_backend.demo.run import DemoConfig


def lr_at(cfg: DemoConfig, step: int, spent: float) -> float:
    """The learning rate of RL step `step` (1-based) with `spent` of the budget used.

    Linear warm-up over the first `lr_warmup_steps` steps (Adam's first updates move every
    weight by ~lr, whatever the gradient's size), then a linear decay by the share of the
    budget spent, to `lr_end` at its end.
    """
    if step <= cfg.lr_warmup_steps:
        return cfg.lr * step / cfg.lr_warmup_steps
    if cfg.lr_end is None:
        return cfg.lr
    return cfg.lr + (cfg.lr_end - cfg.lr) * min(1.0, max(0.0, spent))


def spent(cfg: DemoConfig, step: int, elapsed_s: float) -> float:
    """Share of the RL budget used after `step` steps and `elapsed_s` seconds: the larger of the
    time share and, with max_steps, the step share (a step budget ends where the time cap would)."""
    share = elapsed_s / (cfg.minutes * 60)
    if cfg.max_steps:
        share = max(share, step / cfg.max_steps)
    return share
