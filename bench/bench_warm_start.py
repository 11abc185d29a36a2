"""The warm starts' SFT steps: the padded batch against `backward_batch`, side by side.

The warm starts (SmolLM2's LoRA SFT in trainer_backend/demo/smol_warm.py, the tiny model's full SFT
in trainer_backend/demo/warm_start.py) backpropagate each batch of demonstrations with
`backward_batch` (trainer_backend/demo/sft.py): logits only at the positions the loss reads, and
the rows' common prefix decoded once where that computes fewer tokens, else one row at a time,
unpadded. Before, the batch was right-padded and the causal LM's own `labels` loss computed the
logits at every position (`padded_batch_loss`, kept as the reference). For each batch of a task's
warm start (its demonstrations and steps: SmolLM2's batches of 4, the tiny model's of 32) this runs
both on the same model, alternating which goes first, and reports the time of each, their ratio,
and the largest relative difference between their gradients. No optimizer step: every batch sees
the same weights.

    python bench/bench_warm_start.py [--task bfcl --task arith --task tiny] [--steps N] [--threads N]
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
from trainer_backend.demo.sft import backward_batch, padded_batch_loss, shared_prefix  # noqa: E402
from trainer_backend.demo.smol_warm import SmolWarmStart, arith_demonstrations, sft_example  # noqa: E402
from trainer_backend.engines.precision import cpu_kind  # noqa: E402

log = logging.getLogger("bench_warm_start")
MODEL = Path.home() / ".cache/lightning-middleware/models/smollm2-135m-instruct-tools"
SMOL_TASKS = {"bfcl": (smol_bfcl.demonstrations, smol_bfcl.SFT_STEPS), "arith": (arith_demonstrations, smol.SFT_STEPS)}
TASKS = (*SMOL_TASKS, "tiny")
Batch = list[tuple[list[int], list[int]]]


def gradients(params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    for p in params:
        p.grad = None
    return out


def smol_batches(model_dir: Path, task: str, steps: int | None) -> tuple[Any, int, list[Batch]]:
    """SmolLM2 with a fresh LoRA adapter, as the warm start trains it, and the task's batches."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_backend.engines.lora import AdapterConfig, peft_config

    torch.manual_seed(0)
    demonstrations, default_steps = SMOL_TASKS[task]
    cfg = SmolWarmStart(steps=steps or default_steps)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           peft_config(AdapterConfig(rank=cfg.rank, alpha=2 * cfg.rank)))
    examples = demonstrations(cfg.steps * cfg.batch, cfg.seed)
    batches = [[sft_example(tok, m, t) for m, t in examples[step * cfg.batch:(step + 1) * cfg.batch]]
               for step in range(cfg.steps)]
    return model, tok.pad_token_id, batches


def tiny_batches(steps: int | None) -> tuple[Any, int, list[Batch]]:
    """The tiny model freshly built (random weights, every parameter trained) and the batches its
    warm start draws: last-turn episodes, 32 a batch."""
    import random
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_backend.demo import warm_start as tiny
    from trainer_backend.demo.task import HIGH, LOW, demo_decision

    cfg = tiny.WarmStartConfig().resolved()
    with tempfile.TemporaryDirectory() as tmp:
        tiny.build_base_model(tmp, cfg)
        tok = AutoTokenizer.from_pretrained(tmp)
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    demo_rng, rng = random.Random(f"demos:{cfg.seed}"), random.Random(cfg.seed)
    examples = []
    for _ in range(cfg.demos):
        secret = demo_rng.randint(LOW, HIGH)
        examples.append(tiny.sft_example(tok, secret, demo_decision(secret, demo_rng, cfg.noise), last_only=True))
    batches = [[examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
               for _ in range(steps or cfg.sft_steps)]
    return model, tok.pad_token_id or 0, batches


def bench_task(model: Any, pad: int, batches: list[Batch], task: str) -> dict[str, Any]:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    rows: list[dict[str, Any]] = []
    for step, batch in enumerate(batches):
        times: dict[str, float] = {}
        grads: dict[str, list[torch.Tensor]] = {}
        for name in (("padded", "now") if step % 2 == 0 else ("now", "padded")):
            t0 = time.perf_counter()
            if name == "padded":
                padded_batch_loss(model, batch, pad).backward()
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
                 "gradients differ by %.1e", task, step + 1, len(batches), lengths, shared_prefix(batch),
                 times["padded"], times["now"], times["padded"] / times["now"], diff)
    padded, now = sum(r["padded"] for r in rows), sum(r["now"] for r in rows)
    real = sum(sum(r["lengths"]) for r in rows)
    return {"task": task, "steps": len(batches), "tokens": real,
            "padded_tokens": sum(len(r["lengths"]) * max(r["lengths"]) for r in rows),
            "padded_s": padded, "backward_batch_s": now, "speedup": padded / now,
            "max_grad_rel_diff": max(r["grad_rel_diff"] for r in rows), "per_step": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", action="append", choices=TASKS, help="default: all")
    p.add_argument("--steps", type=int, help="batches per task (default: the task's warm-start steps)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--model", type=Path, default=MODEL, help="SmolLM2 with its tools template (a demo run makes it)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tasks = args.task or list(TASKS)
    if any(t in SMOL_TASKS for t in tasks) and not (args.model / "config.json").exists():
        sys.exit(f"no model at {args.model}: run `lightning-mw demo --model smollm2 --task arith` once to build it")
    torch.set_num_threads(args.threads)
    results = []
    for task in tasks:
        model, pad, batches = tiny_batches(args.steps) if task == "tiny" else smol_batches(args.model, task, args.steps)
        results.append(bench_task(model, pad, batches, task))
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
