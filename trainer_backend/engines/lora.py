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
from collections.abc import Sequence
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


@dataclass(frozen=True)
class SharedAdapter:
    """One adapter of a peft model that several engines share (engines/policies.py)."""

    model: Any
    name: str
    base_dir: Path


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_of(adapter_dir: str | Path) -> Path:
    """The base model folder an adapter was trained on (peft records it in its config)."""
    cfg = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    base = cfg.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ValueError(f"{adapter_dir}: the adapter's base model {base!r} is not a local folder")
    return Path(base)


def peft_config(config: AdapterConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=list(config.target_modules), bias="none", task_type="CAUSAL_LM")


def load(model_dir: str | Path, config: AdapterConfig, *, dtype: torch.dtype, name: str = "default"
         ) -> tuple[Any, Path]:
    """(a peft model with a trainable adapter `name`, the base model folder): a new adapter on the
    model in `model_dir`, or the adapter saved there, on its base."""
    from peft import PeftModel, get_peft_model

    if is_adapter_dir(model_dir):
        base_dir = base_of(model_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
        model = PeftModel.from_pretrained(base, str(model_dir), adapter_name=name, is_trainable=True)
        log.info("LoRA adapter %s resumed from %s on %s", name, model_dir, base_dir)
        return model, base_dir
    base_dir = Path(model_dir).resolve()  # recorded in the adapter's config: absolute, so a resume finds it
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    # peft's default init: A random, B zero, so a new adapter starts as the base model exactly.
    return get_peft_model(base, peft_config(config), adapter_name=name), base_dir


def add(model: Any, name: str, config: AdapterConfig, saved: Path | None) -> None:
    """Another adapter on the same peft model: the one saved in `saved`, or a new one."""
    if saved is not None and is_adapter_dir(saved):
        model.load_adapter(str(saved), adapter_name=name, is_trainable=True)
    else:
        model.add_adapter(name, peft_config(config))


def load_set(root: Path, names: Sequence[str], config: AdapterConfig, *, dtype: torch.dtype
             ) -> tuple[Any, Path, bool]:
    """(one peft model holding an adapter per name, the base folder, whether they were resumed):
    from `root/<name>/` adapter folders when all exist, else new adapters on the model in `root`."""
    resumed = all(is_adapter_dir(root / n) for n in names)
    first = root / names[0]
    model, base_dir = load(first if resumed else root, config, dtype=dtype, name=names[0])
    for name in names[1:]:
        add(model, name, config, root / name if resumed else None)
    return model, base_dir, resumed


def adapter_parameters(model: Any, name: str) -> list[torch.nn.Parameter]:
    """The trainable tensors of adapter `name` (peft names them `...lora_A.<name>.weight`)."""
    return [p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n]


def save_adapter(model: Any, name: str, out: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Adapter `name` alone, as peft saves one (what vLLM loads): `adapter_model.safetensors` and
    `adapter_config.json` directly in `out` (peft's own save puts a non-default adapter in a
    subfolder). `state_dict`: the full model's, to save other values than the live ones."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    weights = get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=name)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    model.peft_config[name].save_pretrained(str(out))
