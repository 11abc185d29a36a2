"""A SmolLM2 SFT warm start's steps: the padded batch against `backward_batch`, side by side.

The warm start (trainer_backend/demo/smol_warm.py) backpropagates each batch of demonstrations with
`backward_batch`: logits only at the positions the loss reads, and the rows' common prefix decoded
once where that computes fewer tokens, else one row at a time, unpadded. Before, the batch was
right-padded and the causal LM's own `labels` loss computed the 49k-wide logits at every position
(`padded_batch_loss`, kept as the reference). For each batch of a task's warm start
(its demonstrations, its steps, batches of 4) this runs both on the same LoRA model, alternating
which goes first, and reports the time of each, their ratio, and the largest relative difference
between their gradients. No optimizer step: every batch sees the same weights.

    python bench/bench_warm_start.py [--task bfcl --task arith] [--steps N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from trainer_backend.demo import smol, smol_bfcl  # noqa: E402
from trainer_backend.demo.smol_warm import (  # noqa: E402
    SmolWarmStart,
    arith_demonstrations,
    backward_batch,
    padded_batch_loss,
    sft_example,
    shared_prefix,
)
from trainer_backend.engines.precision import cpu_kind  # noqa: E402

log = logging.getLogger("bench_warm_start")
MODEL = Path.home() / ".cache/lightning-middleware/models/smollm2-135m-instruct-tools"
TASKS = {"bfcl": (smol_bfcl.demonstrations, smol_bfcl.SFT_STEPS), "arith": (arith_demonstrations, smol.SFT_STEPS)}


def gradients(params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    for p in params:
        p.grad = None
    return out


def bench_task(model: Any, tok: Any, task: str, steps: int | None) -> dict[str, Any]:
    demonstrations, default_steps = TASKS[task]
    cfg = SmolWarmStart(steps=steps or default_steps)
    examples = demonstrations(cfg.steps * cfg.batch, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for step in range(cfg.steps):
        batch = [sft_example(tok, m, t) for m, t in examples[step * cfg.batch:(step + 1) * cfg.batch]]
        times: dict[str, float] = {}
        grads: dict[str, list[torch.Tensor]] = {}
        for name in (("padded", "now") if step % 2 == 0 else ("now", "padded")):
            t0 = time.perf_counter()
            if name == "padded":
                padded_batch_loss(model, batch, tok.pad_token_id).backward()
            else:
                backward_batch(model, batch)
            times[name] = time.perf_counter() - t0
            grads[name] = gradients(params)
        diff = max(float((a - b).abs().max() / (a.abs().max() + 1e-12))
                   for a, b in zip(grads["padded"], grads["now"], strict=True))
        lengths = [len(ids) for ids, _ in batch]
        rows.append({"step": step, "lengths": lengths, "shared_prefix": shared_prefix(batch), **times,
                     "grad_rel_diff": diff})
        log.info("%s step %d/%d lengths %s, shared prefix %d: padded %.2f s, backward_batch %.2f s (%.2fx), "
                 "gradients differ by %.1e", task, step + 1, cfg.steps, lengths, shared_prefix(batch),
                 times["padded"], times["now"], times["padded"] / times["now"], diff)
    padded, now = sum(r["padded"] for r in rows), sum(r["now"] for r in rows)
    real = sum(sum(r["lengths"]) for r in rows)
    return {"task": task, "steps": cfg.steps, "tokens": real,
            "padded_tokens": sum(len(r["lengths"]) * max(r["lengths"]) for r in rows),
            "padded_s": padded, "backward_batch_s": now, "speedup": padded / now,
            "max_grad_rel_diff": max(r["grad_rel_diff"] for r in rows), "per_step": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", action="append", choices=sorted(TASKS), help="default: both")
    p.add_argument("--steps", type=int, help="batches per task (default: the task's warm-start steps)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--model", type=Path, default=MODEL, help="SmolLM2 with its tools template (a demo run makes it)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not (args.model / "config.json").exists():
        sys.exit(f"no model at {args.model}: run `lightning-mw demo --model smollm2 --task arith` once to build it")
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_backend.engines.lora import AdapterConfig, peft_config

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = SmolWarmStart()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
                           peft_config(AdapterConfig(rank=cfg.rank, alpha=2 * cfg.rank)))
    results = [bench_task(model, tok, task, args.steps) for task in (args.task or sorted(TASKS))]
    print(f"\n{cpu_kind()}, {args.threads} threads, torch {torch.__version__}")
    print("| task | steps | tokens (padded) | padded s | backward_batch s | speedup | max grad rel diff |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['task']} | {r['steps']} | {r['tokens']} ({r['padded_tokens']}) | {r['padded_s']:.1f} | "
              f"{r['backward_batch_s']:.1f} | {r['speedup']:.2f}x | {r['max_grad_rel_diff']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_kind(), "threads": args.threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
