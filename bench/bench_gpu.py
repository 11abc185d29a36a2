"""The torch engine on a GPU: training tokens/s and MFU of Qwen2-0.5B- and 1.5B-shaped models
(random weights, built on the machine: no download), full fine-tuning and LoRA, bf16, on real
rows from a stored CPU run, against the device's measured bf16 matmul peak.

    python bench/bench_gpu.py export --store runs/smol-0/traces.db     # once, here: real rows
    python bench/bench_gpu.py run --out "$OUT"                        # on the GPU machine
    python bench/bench_gpu.py run --device cpu --models tiny --steps 1  # a smoke run anywhere

On the lent H200 (Python 3.12, torch 2.11, transformers, peft; no SQLAlchemy or orjson, which
the trainer's packages import): download those two wheels here first (the device README's
`pip download ... --python-version 3.12 ... -d .whl sqlalchemy==2.1.9 orjson==3.13.0`), then
`run(carry=[".whl"])` with `python3 -m pip install -q --no-index --no-deps --target /tmp/site
.whl/*.whl && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py run`.

`export` writes `bench/data/smol-rows.jsonl`: the training rows (token IDs, loss mask, vLLM's
log-probs) the trainer built from a stored run of `lightning-mw demo --model smollm2`, with
their rollout-level GRPO advantages. SmolLM2's token IDs (< 49,152) are valid in Qwen2's
151,936-entry vocabulary; what is measured is the engine's speed on real row lengths and masks,
not what the model learns.

MFU = model FLOPs / s / peak. Full fine-tuning counts 6 N per token (forward 2N, backward 4N);
LoRA counts 4 N (the frozen base needs no weight gradients; the adapter's own FLOPs are <1%).
The LM head (vocab x hidden) is counted only at positions that predict a trained token, the
only ones where the engine computes logits; attention scores are not counted. Peak: the best
of repeated 8192^3 bf16 matmuls on the device. Prints a table and writes `bench_gpu.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer_backend  # noqa: E402,F401  (before torch: passive OpenMP waits)

# isort: split
import torch  # noqa: E402

ROWS = Path(__file__).resolve().parent / "data" / "smol-rows.jsonl"
MODELS = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab, tied), Qwen2's published shapes
    "qwen2-0.5B": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2-1.5B": (1536, 28, 12, 2, 8960, 151936, True),
    "tiny": (64, 2, 4, 2, 128, 151936, True),  # the smoke run's
}
log = logging.getLogger("bench_gpu")


# ---------------------------------------------------------------- rows from a stored run


def export_rows(store_url: str, out: Path, limit: int) -> int:
    """The rows a trainer would build from the store's succeeded, rewarded train rollouts."""
    from lightning_middleware import TraceStore
    from lightning_middleware.rows import build_rows_for_rollouts, with_advantages
    from trainer_backend.algorithms.advantages import rollout_advantages

    store = TraceStore(store_url if "://" in store_url else f"sqlite:///{store_url}")
    rollouts = [r for r in store.query_rollouts(status="succeeded", mode="train") if r.final_reward is not None][:limit]
    calls = store.calls_for([r.id for r in rollouts], training_only=True)
    rows, _ = build_rows_for_rollouts((r, calls[r.id]) for r in rollouts)
    rows = with_advantages(rows, rollout_advantages({r.id: float(r.final_reward or 0.0) for r in rollouts},
                                                    {r.id: r.task_id or r.id for r in rollouts}))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps({"input_ids": row.input_ids, "loss_mask": row.loss_mask, "advantage": row.advantage,
                                "behaviour_logprobs": row.behaviour_logprobs, "task_id": row.task_id}) + "\n")
    return len(rows)


def load_rows(path: Path, n: int) -> list:
    """`n` rows, the file's rows repeated as needed (each a distinct rollout to the engine)."""
    from lightning_middleware.rows import Row

    stored = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not stored:
        raise SystemExit(f"no rows in {path}: run `bench_gpu.py export --store ...` first")
    rows = []
    for i in range(n):
        s = stored[i % len(stored)]
        lp = s["behaviour_logprobs"]
        rows.append(Row(rollout_id=f"r{i}", task_id=s["task_id"], agent=None, input_ids=tuple(s["input_ids"]),
                        loss_mask=tuple(s["loss_mask"]), behaviour_logprobs=None if lp is None else tuple(lp),
                        advantage=float(s["advantage"])))
    return rows


# ---------------------------------------------------------------- measurements


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_peak(device: torch.device, n: int = 8192, seconds: float = 5.0) -> float:
    """Best FLOP/s of repeated n x n x n bf16 matmuls (batches of 10 between syncs). On CPU, the
    CPU check of this script's path: n grows from 256 to at most 1024 while one matmul takes under
    20 ms, for one second (a CPU that emulates bf16 took 7 s per 1024^3 matmul, 76 s a probe)."""
    if device.type == "cuda":
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    else:
        seconds, n = min(seconds, 1.0), 256
        while True:
            a, b = (torch.randn(n, n, dtype=torch.bfloat16) for _ in range(2))
            t0 = time.perf_counter()
            torch.matmul(a, b)
            if n >= 1024 or time.perf_counter() - t0 > 0.02:
                break
            n *= 2
    for _ in range(3):
        torch.matmul(a, b)
    sync(device)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(10):
            torch.matmul(a, b)
        sync(device)
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def make_model(root: Path, name: str) -> tuple[Path, int]:
    import transformers

    hidden, layers, heads, kv, inter, vocab, tied = MODELS[name]
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   max_position_embeddings=4096, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    path = root / name
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def bench_cell(path: Path, n_params: int, name: str, mode: str, rows: list, *, device: torch.device,
               steps: int, peak: float, micro_batch_tokens: int, precision: str = "bf16") -> dict:
    """One model x mode: a warm-up step, then `steps` timed steps (the best one counts)."""
    from trainer_backend.engines.lora import AdapterConfig
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    hidden, vocab = MODELS[name][0], MODELS[name][5]
    lora = AdapterConfig(rank=16) if mode == "lora" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    engine = TorchEngine(path, TorchEngineConfig(lr=1e-6, precision=precision, lora=lora,
                                                 micro_batch_tokens=micro_batch_tokens,
                                                 activation_budget_mb=None), device=str(device))
    load_s = time.perf_counter() - t0
    engine.step(rows)  # warm-up: allocator, kernels
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step(rows)
        sync(device)
        times.append(time.perf_counter() - t0)
    t = min(times)
    tokens = sum(len(r.input_ids) for r in rows)
    trained = sum(sum(r.loss_mask) for r in rows)
    head = vocab * hidden
    per_token = 6 if mode == "full" else 4
    flops = per_token * (n_params * tokens - head * (tokens - trained)) / t
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(model=name, mode=mode, params_m=n_params / 1e6, rows=len(rows), tokens=tokens, trained=trained,
                step_s=t, steps_s=times, tokens_per_s=tokens / t, mfu=flops / peak, load_s=load_s,
                max_memory_gib=memory)


# ---------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    rows = load_rows(Path(args.rows), args.batch)
    peak = bf16_peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log.info("%s: bf16 matmul peak %.1f TFLOP/s; %d rows, %d tokens per step", name, peak / 1e12, len(rows),
             sum(len(r.input_ids) for r in rows))
    cells = []
    with tempfile.TemporaryDirectory() as d:
        for model in args.models.split(","):
            path, n_params = make_model(Path(d), model)
            for mode in args.modes.split(","):
                try:
                    cell = bench_cell(path, n_params, model, mode, rows, device=device, steps=args.steps, peak=peak,
                                      micro_batch_tokens=args.micro_batch_tokens, precision=args.precision)
                except Exception as exc:  # noqa: BLE001 - a failed cell is reported, the others still run
                    log.exception("%s %s failed", model, mode)
                    cell = dict(model=model, mode=mode, error=f"{type(exc).__name__}: {exc}")
                cells.append(cell)
                log.info("%s", json.dumps(cell))
    return dict(device=name, torch=torch.__version__, peak_bf16_tflops=peak / 1e12, cells=cells)


def print_table(result: dict) -> None:
    print(f"\n{result['device']} (torch {result['torch']}), bf16 peak {result['peak_bf16_tflops']:.1f} TFLOP/s")
    print("| model | mode | params (M) | step s | tokens/s | MFU | max memory GiB |")
    print("|---|---|---|---|---|---|---|")
    for c in result["cells"]:
        if "error" in c:
            print(f"| {c['model']} | {c['mode']} | failed: {c['error'][:80]} | | | | |")
            continue
        mem = "-" if c["max_memory_gib"] is None else f"{c['max_memory_gib']:.1f}"
        print(f"| {c['model']} | {c['mode']} | {c['params_m']:.0f} | {c['step_s']:.3f} | {c['tokens_per_s']:,.0f} "
              f"| {100 * c['mfu']:.1f}% | {mem} |")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write real training rows from a stored run")
    ex.add_argument("--store", required=True, help="a store URL or a SQLite file")
    ex.add_argument("--out", default=str(ROWS))
    ex.add_argument("--rollouts", type=int, default=64)
    rn = sub.add_parser("run", help="measure")
    rn.add_argument("--device", default="cuda")
    rn.add_argument("--models", default="qwen2-0.5B,qwen2-1.5B")
    rn.add_argument("--modes", default="full,lora")
    rn.add_argument("--rows", default=str(ROWS))
    rn.add_argument("--batch", type=int, default=64, help="rows per step")
    rn.add_argument("--steps", type=int, default=3)
    rn.add_argument("--micro-batch-tokens", type=int, default=16384)
    rn.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="fp32: the CPU check on a CPU without native bf16 (MFU is still against the bf16 peak)")
    rn.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.cmd == "export":
        print(f"{export_rows(args.store, Path(args.out), args.rollouts)} rows -> {args.out}")
        return
    result = run(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_gpu.json").write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
