"""`lightning-mw merge-lora ADAPTER --out DIR`: a trained LoRA adapter merged into its base model,
written as a plain Hugging Face folder that any server (vLLM without `--enable-lora`, TGI,
transformers) loads as it is.

The weights are merged in fp32 (W + B A x alpha / r, peft's `merge_and_unload`) and saved in the
base's own dtype unless `dtype` says otherwise; the tokenizer and chat template are the base's
(an adapter is trained and served on them), so the merged folder tokenises as training did.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from lightning_middleware.errors import UsageError

log = logging.getLogger(__name__)

DTYPES = ("base", "float32", "bfloat16", "float16")


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, *, base: str | Path | None = None,
                  dtype: str = "base") -> Path:
    """Merge `adapter_dir` into its base (recorded in its config, or `base`); the folder written."""
    import torch  # here, not at the top: registering the command imports nothing heavy
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer_backend.engines.torch_engine import TOKENIZER_FILES

    adapter, out = Path(adapter_dir), Path(out_dir)
    base_dir = _base(adapter, base)
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} exists and is not empty: choose a new folder")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    saved_dtype = _config_dtype(base_dir) if dtype == "base" else dtype
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.to(getattr(torch, saved_dtype)).save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, tmp / name)
    (tmp / "merged_from.json").write_text(json.dumps({"adapter": str(adapter.resolve()),
                                                      "base": str(base_dir.resolve()), "dtype": saved_dtype}))
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    log.info("merged %s into %s: %s (%s)", adapter, base_dir, out, saved_dtype)
    return out


def _base(adapter: Path, base: str | Path | None) -> Path:
    from trainer_backend.engines.lora import base_of, is_adapter_dir

    if not adapter.is_dir():
        raise UsageError(f"no adapter folder at {adapter}")
    if not is_adapter_dir(adapter):
        raise UsageError(f"{adapter} has no adapter_config.json: not a LoRA adapter folder (a full checkpoint "
                         "is served as it is)")
    if base is not None:
        if not (Path(base) / "config.json").is_file():
            raise UsageError(f"--base {base}: not a Hugging Face model folder (no config.json)")
        return Path(base)
    try:
        return base_of(adapter)
    except ValueError as exc:
        raise UsageError(f"{exc}; name it with --base") from None


def _config_dtype(base_dir: Path) -> str:
    cfg = json.loads((base_dir / "config.json").read_text())
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return name if name in DTYPES else "float32"
