"""LoRA on the verl engine, through verl 0.9.1's own LoRA support.

verl's FSDP engine builds the adapter itself when `model.lora_rank > 0`
(`verl/workers/engine/fsdp/transformer_impl.py`, `_build_lora_module`): peft's `get_peft_model`
with `lora_rank`, `lora_alpha`, `target_modules`, or `PeftModel.from_pretrained(lora_adapter_path,
is_trainable=True)` to continue a saved adapter; peft freezes the base, so verl's optimizer
holds the adapter alone. verl's rollout sync extracts the adapter with
`get_per_tensor_param(base_sync_done=True)` (`collect_lora_params`: peft's
`get_peft_model_state_dict`, with the adapter's peft config). This module maps our LoRA
settings onto those config keys and writes what verl hands out:

- publish: the adapter as peft saves one (`adapter_model.safetensors`, `adapter_config.json`),
  the folder the torch engine's LoRA writes, so the publisher loads it into vLLM in place;
- resume: verl's own checkpoint with `save_lora_only` (the adapter, optimizer, lr schedule and
  RNG, one shard per rank) in `verl_state/` beside it. A restarted engine loads the adapter from
  the folder (`lora_adapter_path`) and then that state (verl's `load_checkpoint`), when the
  world size is the one it was saved with (else the optimizer starts fresh, with a warning).

One adapter per engine: verl's engine names its adapter "default" and reads that one
everywhere downstream (`get_per_tensor_param`'s `peft_config.get("default")`, the checkpoint's
`_get_lora_train_meta`, `disable_adapter`), so several policies are one engine each
(`engines/verl_policies.py`), each with its own copy of the base model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from trainer_backend.engines import lora

log = logging.getLogger(__name__)

STATE_DIR = "verl_state"  # verl's sharded checkpoint of the adapter, optimizer and schedule
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def actor_overrides(model_dir: str | Path, adapter: lora.AdapterConfig | None) -> tuple[Path, list[str]]:
    """(the base model folder, verl config overrides) of a LoRA actor: a new adapter `adapter` on
    the model in `model_dir`, or the adapter saved in `model_dir`, continued on its base."""
    a = "actor_rollout_ref"
    if lora.is_adapter_dir(model_dir):
        base = lora.base_of(model_dir)
        saved = json.loads((Path(model_dir) / lora.ADAPTER_CONFIG).read_text())
        rank, alpha, targets = int(saved["r"]), int(saved["lora_alpha"]), sorted(saved["target_modules"])
        extra = [f"{a}.model.lora_adapter_path={Path(model_dir).resolve()}"]
    else:
        if adapter is None:
            raise ValueError(f"{model_dir} is no LoRA adapter and no adapter config was given")
        base, rank, alpha, targets, extra = Path(model_dir).resolve(), adapter.rank, adapter.alpha, \
            list(adapter.target_modules), []
    if adapter is not None and adapter.dropout:
        raise ValueError("the verl engine's LoRA has no dropout (verl 0.9.1's LoRA config has no lora_dropout key); "
                         "use dropout 0 or the torch engine")
    return base, [
        f"{a}.model.lora_rank={rank}",
        f"{a}.model.lora_alpha={alpha}",
        f"{a}.model.target_modules=[{','.join(targets)}]",
        # the resume state: verl's sharded checkpoint, adapter weights only (the base is the model folder)
        f"{a}.actor.checkpoint.save_contents=[model,optimizer,extra]",
        f"+{a}.actor.checkpoint.save_lora_only=True",
        *extra,
    ]


def export_adapter(engine: Any, out_dir: str | Path, *, rank: int) -> None:
    """Write the adapter of verl's training engine as a peft adapter folder (every rank calls this:
    the FSDP shards are gathered collectively; rank 0 writes)."""
    from peft import get_peft_config
    from safetensors.torch import save_file

    params, peft_config = engine.get_per_tensor_param(base_sync_done=True)  # verl's rollout adapter sync
    if peft_config is None:
        raise RuntimeError("the verl actor has no LoRA adapter to export (model.lora_rank is 0)")
    weights = {name: t.detach().contiguous().cpu() for name, t in params}
    if rank != 0:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    get_peft_config(peft_config).save_pretrained(str(out))


def keep_state(checkpoint: Path, out: Path) -> None:
    """Move verl's checkpoint (adapter, optimizer and schedule shards) into `out/verl_state/`."""
    state = out / STATE_DIR
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    for p in checkpoint.iterdir():
        if p.is_file():
            shutil.move(str(p), state / p.name)
    shutil.rmtree(checkpoint, ignore_errors=True)


def resumable_state(model_dir: Path, world_size: int) -> Path | None:
    """`model_dir/verl_state` when it holds verl's state saved on `world_size` ranks, else None."""
    state = model_dir / STATE_DIR
    meta = state / "fsdp_config.json"
    if not meta.is_file():
        return None
    saved = json.loads(meta.read_text()).get("world_size")
    if saved != world_size:
        log.warning("%s was saved on %s ranks, this engine has %d: the adapter continues, its optimizer starts "
                    "fresh", state, saved, world_size)
        return None
    return state
