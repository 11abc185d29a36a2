"""Peak memory (VmHWM) and step time of TorchEngine GRPO steps on SmolLM2-135M's shape, one fresh
process per engine configuration (a process's high-water mark only grows).

Rows like the SmolLM2 arithmetic demo's: 16 rows of ~380 tokens, a ~315-token prompt (the tools
system prompt), then a completion, a tool result (not trained) and a second completion, so a
micro-batch's trained positions (the union over its rows) are ~1/3 of its tokens. The engine
config is the demo's (fp32, frozen tied embeddings, lr 2e-5); `--response R` instead makes
every row a prompt of 64 tokens plus R trained tokens (where the output layer's logits matter).

    python bench/bench_trainer_memory.py [--steps 2] [--configs base,act4096,act2048]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: TorchEngineConfig overrides. "base": the engine before activation and logits budgets.
CONFIGS: dict[str, dict] = {
    "base": {"activation_budget_mb": None, "logits_budget_mb": None},
    "act4096": {"activation_budget_mb": 4096, "logits_budget_mb": None},
    "act2048": {"activation_budget_mb": 2048, "logits_budget_mb": None},
    "act2048+chunk256": {"activation_budget_mb": 2048, "logits_budget_mb": 256},
    "act4096+chunk256": {"activation_budget_mb": 4096, "logits_budget_mb": 256},
    "chunk256": {"activation_budget_mb": None, "logits_budget_mb": 256},
}


def status_gb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    raise KeyError(key)


def demo_rows(n: int, vocab: int, response: int | None) -> list:
    from lightning_middleware.rows import Row

    rng = random.Random(0)
    rows = []
    for i in range(n):
        if response is None:
            segs = [(rng.randint(290, 340), 0), (rng.randint(20, 40), 1), (rng.randint(15, 30), 0),
                    (rng.randint(8, 20), 1)]
        else:
            segs = [(64, 0), (response, 1)]
        ids: list[int] = []
        mask: list[int] = []
        for length, m in segs:
            ids += [rng.randrange(vocab) for _ in range(length)]
            mask += [m] * length
        rows.append(Row(rollout_id=f"r{i}", task_id=f"t{i // 4}", agent=None, input_ids=tuple(ids),
                        loss_mask=tuple(mask), behaviour_logprobs=tuple(-1.0 * m for m in mask),
                        advantage=1.0 if i % 2 else -1.0))
    return rows


def child(name: str, model_dir: str, steps: int, rows: int, response: int | None) -> dict:
    import torch

    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))  # the demo's trainer: 1 thread
    eng = TorchEngine(model_dir, TorchEngineConfig(lr=2e-5, freeze_embeddings=True, precision="fp32",
                                                   **CONFIGS[name]))
    batch = demo_rows(rows, eng.model.config.vocab_size, response)
    out: dict = {"config": name, "tokens": sum(len(r) for r in batch), "micro_batch_tokens": eng.micro_batch_tokens,
                 "hwm_after_load_gb": status_gb("VmHWM"), "steps": []}
    for _ in range(steps):
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        m = eng.step(batch)
        out["steps"].append({"s": time.perf_counter() - t0, "micro_batches": m["micro_batches"],
                             "hwm_gb": status_gb("VmHWM"), "load": load})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--response", type=int, default=None, help="rows of 64 prompt + R trained tokens")
    p.add_argument("--configs", default="base,act4096,act2048")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model_dir, a.steps, a.rows, a.response)))
        return
    from bench.bench_trainer import make_model

    with tempfile.TemporaryDirectory() as d:
        model_dir, _, _ = make_model(d, "smollm2-135M")
        for name in a.configs.split(","):
            cmd = [sys.executable, __file__, "--child", name, "--model-dir", model_dir, "--steps", str(a.steps),
                   "--rows", str(a.rows)] + (["--response", str(a.response)] if a.response else [])
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            steps = res["steps"]
            print(f"{name:18s} tokens {res['tokens']}, micro-batch <= {res['micro_batch_tokens']} tokens, "
                  + ", ".join(f"step {i}: {s['s']:.1f} s ({s['micro_batches']:.0f} mb, load {s['load']:.1f}) "
                              f"peak RSS {s['hwm_gb']:.2f} GiB" for i, s in enumerate(steps)), flush=True)


if __name__ == "__main__":
    main()
