"""LoRA adapters for the torch engine, through peft: the base model frozen, low-rank updates
trained, the adapter saved on its own (a few MB) and hot-loaded into vLLM by name.

A checkpoint of a LoRA policy is a peft adapter folder (`adapter_config.json`,
`adapter_model.safetensors`, plus the engine's `trainer_state.pt`); its config names the base
model folder, so a resumed engine finds the base again. The frozen reference for KL and DPO is
the base itself, with the adapter switched off (`disable_adapter`): no second copy of the model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
# Every linear layer of a Llama/Qwen2-style decoder: attention and MLP (what vLLM's LoRA serves).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int = 8
    alpha: int = 16  # the update is scaled by alpha / rank
    dropout: float = 0.0  # 0: the old log-probs and the update see the same network
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_of(adapter_dir: str | Path) -> Path:
    """The base model folder an adapter was trained on (peft records it in its config)."""
    cfg = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    base = cfg.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ValueError(f"{adapter_dir}: the adapter's base model {base!r} is not a local folder")
    return Path(base)


def load(model_dir: str | Path, config: AdapterConfig, *, dtype: torch.dtype) -> tuple[Any, Path]:
    """(a peft model with a trainable adapter, the base model folder): a new adapter on the
    model in `model_dir`, or the adapter saved there, on its base."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if is_adapter_dir(model_dir):
        base_dir = base_of(model_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
        model = PeftModel.from_pretrained(base, str(model_dir), is_trainable=True)
        log.info("LoRA adapter resumed from %s on %s", model_dir, base_dir)
        return model, base_dir
    base_dir = Path(model_dir).resolve()  # recorded in the adapter's config: absolute, so a resume finds it
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    peft_cfg = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=list(config.target_modules), bias="none", task_type="CAUSAL_LM")
    # peft's default init: A random, B zero, so a new adapter starts as the base model exactly.
    return get_peft_model(base, peft_cfg), base_dir
