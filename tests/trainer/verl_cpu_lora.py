"""verl 0.9.1's real actor with verl's own LoRA (model.lora_rank: peft on the FSDP2 engine), in ONE CPU
process, for tests/trainer/test_engine_verl_lora.py; the CPU set-up of verl_cpu_actor.py. Not for production.

    python tests/trainer/verl_cpu_lora.py MODEL_DIR ADAPTER_DIR ROWS.pt OUT_DIR
    python tests/trainer/verl_cpu_lora.py train MODEL_DIR ROWS.pt OUT_DIR STEPS LR RANK

Runs `VerlEngine` (its own __init__/step/save, the worker built in this process) four ways and
writes what the test compares to OUT_DIR/out.pt:
  same_init  from ADAPTER_DIR (verl's lora_adapter_path), SGD lr 1, no clipping: the adapter's
             change is minus its gradient; every other parameter is compared bit for bit;
  fresh      a new adapter (verl's get_peft_model), AdamW, one step, published to OUT_DIR/fresh;
  resume     AdamW from ADAPTER_DIR: step, save to OUT_DIR/c1, step (the continuous run); then an
             engine resumed from OUT_DIR/c1 takes the same second step, and one from a copy of it
             without verl's state (a fresh optimizer) too.
`train` (tests/serving/test_lora_serving.py): a new adapter saved to OUT_DIR/v0, STEPS AdamW steps
on ROWS, saved to OUT_DIR/v1: what the trainer publishes to vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.trainer.verl_cpu_actor import CPU_OVERRIDES, in_process_worker, start_cpu_process_group  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.engines.lora import AdapterConfig  # noqa: E402
from trainer_backend.engines.verl_engine import VerlEngine, VerlEngineConfig  # noqa: E402

ADAPTER = AdapterConfig(rank=4, alpha=8)


def config(optimizer: str, lr: float) -> VerlEngineConfig:
    return VerlEngineConfig(lr=lr, grad_clip=1e9, param_dtype="fp32", strategy="fsdp2", use_dynamic_bsz=True,
                            max_token_len_per_gpu=40, gradient_checkpointing=False, lora=ADAPTER,
                            loss=LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=None),
                            overrides=(*CPU_OVERRIDES, f"actor_rollout_ref.actor.optim.optimizer={optimizer}"))


def engine(model_dir: Path, cfg: VerlEngineConfig, out: Path) -> VerlEngine:
    return VerlEngine(model_dir, cfg, work_dir=out / "verl_work", start_workers=in_process_worker)


def params(eng: VerlEngine) -> dict[str, torch.Tensor]:
    module = eng.wg.actor.engine.module
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def trainable(eng: VerlEngine) -> list[str]:
    return sorted(n for n, p in eng.wg.actor.engine.module.named_parameters() if p.requires_grad)


def adapter_of(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in p.items() if "lora_" in n}


def same_init(model_dir: Path, adapter_dir: Path, rows: list, out: Path) -> dict:
    eng = engine(adapter_dir, config("SGD", 1.0), out)
    before = params(eng)
    metrics = eng.step(rows)
    after = params(eng)
    return {"metrics": metrics, "trainable": trainable(eng),
            "grads": {n: before[n] - after[n] for n in adapter_of(before)},  # SGD, lr 1: delta = -grad
            "base_changed": [n for n in before if "lora_" not in n and not torch.equal(before[n], after[n])],
            "n_base": sum(1 for n in before if "lora_" not in n)}


def fresh(model_dir: Path, rows: list, out: Path) -> dict:
    eng = engine(model_dir, config("AdamW", 0.05), out)
    start = adapter_of(params(eng))
    metrics = eng.step(rows)
    saved = eng.save(out / "fresh")
    return {"metrics": metrics, "trainable": trainable(eng), "resumed": eng.resumed,
            "b_zero_at_start": all(float(t.abs().max()) == 0 for n, t in start.items() if "lora_B" in n),
            "saved": sorted(os.listdir(saved)), "state": sorted(os.listdir(saved / "verl_state"))}


def resume(adapter_dir: Path, rows: list, out: Path) -> dict:
    cfg = config("AdamW", 0.01)
    eng = engine(adapter_dir, cfg, out)
    eng.step(rows)
    eng.save(out / "c1")
    after_first = adapter_of(params(eng))
    eng.step(rows)
    continuous = adapter_of(params(eng))
    resumed = engine(out / "c1", cfg, out)
    at_load = adapter_of(params(resumed))
    resumed.step(rows)
    shutil.copytree(out / "c1", out / "c1_no_state", ignore=shutil.ignore_patterns("verl_state"))
    no_state = engine(out / "c1_no_state", cfg, out)
    no_state.step(rows)
    return {"continuous": continuous, "resumed": adapter_of(params(resumed)), "no_state": adapter_of(params(no_state)),
            "after_first": after_first, "at_load": at_load, "resumed_flag": resumed.resumed,
            "no_state_flag": no_state.resumed}


def train(model_dir: Path, rows: list, out: Path, steps: int, lr: float, rank: int) -> None:
    cfg = dataclasses.replace(config("AdamW", lr), lora=AdapterConfig(rank=rank))
    eng = engine(model_dir, cfg, out)
    eng.save(out / "v0")
    for _ in range(steps):
        eng.step(rows)
    eng.save(out / "v1")


def main() -> None:
    if sys.argv[1] == "train":
        start_cpu_process_group()
        model_dir, rows_path, out_dir = (Path(a) for a in sys.argv[2:5])
        train(model_dir, torch.load(rows_path, weights_only=False), out_dir, int(sys.argv[5]), float(sys.argv[6]),
              int(sys.argv[7]))
        torch.distributed.destroy_process_group()
        return
    model_dir, adapter_dir, rows_path, out_dir = (Path(a) for a in sys.argv[1:5])
    start_cpu_process_group()
    rows = torch.load(rows_path, weights_only=False)
    result = {"same_init": same_init(model_dir, adapter_dir, rows, out_dir),
              "fresh": fresh(model_dir, rows, out_dir),
              "resume": resume(adapter_dir, rows, out_dir)}
    torch.save(result, out_dir / "out.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
