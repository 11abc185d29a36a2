"""Separate policies per agent on the torch engine: several LoRA adapters on one frozen base
model, behind the multi-policy `Engine` surface of `engines/policy_set.py` (rows routed by
`Row.policy`, a default policy, metrics per policy, one `policy_version`, `out/<policy>/`
checkpoints), so the daemon itself knows nothing of policies.

The base is loaded once; the engines share one peft model and switch the active adapter (the
others are frozen while one trains). The reference for KL and DPO is the base, every adapter off.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer_backend.engines import lora
from trainer_backend.engines.policy_set import MultiPolicy, check_names
from trainer_backend.engines.torch_config import TorchEngineConfig
from trainer_backend.engines.torch_engine import TorchEngine

log = logging.getLogger(__name__)


class PolicySet(MultiPolicy):
    """LoRA policies `names` on the base in `model_dir`, or resumed from a checkpoint of them."""

    def __init__(self, model_dir: str | Path, names: Sequence[str], config: TorchEngineConfig, *,
                 default: str | None = None, device: str = "cpu", policy_version: int = 0) -> None:
        check_names(names, default)
        root = Path(model_dir)
        model, base_dir, resumed = lora.load_set(root, names, config.lora or lora.AdapterConfig(), dtype=torch.float32)
        self.names, self.default = tuple(names), default
        self.base_dir = base_dir
        self.policy_version = policy_version
        self.engines: dict[str, TorchEngine] = {
            name: TorchEngine(root / name if resumed else base_dir, config, device=device,
                              policy_version=policy_version, shared=lora.SharedAdapter(model, name, base_dir))
            for name in names
        }
        log.info("policy set %s on %s (%s)", ", ".join(names), base_dir, "resumed" if resumed else "new adapters")

    def updates(self, name: str) -> int:
        return int(self.engines[name].scheduler.last_epoch)

    @property
    def lr(self) -> float:
        """The current learning rate (every policy follows one schedule)."""
        return next(iter(self.engines.values())).lr

    def set_lr(self, lr: float) -> None:
        for engine in self.engines.values():
            engine.set_lr(lr)
