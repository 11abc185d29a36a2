"""Trainer benchmarks, side by side in one bounded run (< 5 minutes on 2 CPU cores).

1. Batch assembly from the store, as the daemon's `train()` does it: `store.calls_for`
   (SQLite) + `build_rows_for_rollouts` + `rollout_advantages` + `with_advantages`.
   Store: R rollouts x 4 calls; the prompt of call t+1 is call t's prompt + completion +
   200 observation tokens (it grows ~300 tokens a turn), 100-token completions with
   logprobs, so each rollout merges into one 1,300-token row. Reported in tokens/s of
   training rows (the trainer's output) and of token IDs read from the store (its input).
2. TorchEngine training throughput on Qwen2-style models, fp32 and bf16 autocast, and
   model-FLOPs utilisation against this machine's measured matmul peak:
       MFU = 6 * (N * tokens + N_head * trained positions - N_head * tokens) / s / peak
   N = parameters taking part in matmuls (all parameters; with tied embeddings the embedding
   matrix is counted once, as the LM head; the lookup itself is free). 6N is forward (2N) +
   backward (4N) per token and omits attention scores/values; `MFU+attn` adds those,
   12 * layers * hidden * T_avg_ctx per token (fwd+bwd, causal: average context = T/2).
   The LM head (N_head = vocab x hidden) is counted only at positions that predict a trained
   token, the only ones where the engine computes logits (the bare model computes and is
   credited with all). Precisions: fp32, bf16-autocast (fp32 weights, autocast), bf16 (bf16
   weights and compute, fp32 master weights); `+compile`: torch.compile'd decoder layers (the
   compilation happens in the warm-up step, not timed); `auto`: the engine's default, bf16 where
   the CPU computes it natively and faster (engines/precision.py's probe), else fp32. Peak: best
   of repeated large square `torch.matmul` in bf16 and in fp32, measured here; each mode is
   measured against the peak of the dtype it actually computes in. bf16 modes are skipped by
   default where bf16 is not native (emulated bf16 runs ~60x slower than fp32: ask for them
   with --dtypes to see it).

    python bench/bench_trainer.py [--rollouts 128] [--rows 4 --length 512] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lightning_middleware import LLMCall, TraceStore  # noqa: E402
from lightning_middleware.records import Reward, Rollout, new_id  # noqa: E402
from lightning_middleware.rows import build_rows_for_rollouts, with_advantages  # noqa: E402
from trainer_backend.algorithms.advantages import rollout_advantages  # noqa: E402
from trainer_backend.engines.precision import bf16_probe, cpu_kind, resolve_precision  # noqa: E402
from trainer_backend.engines.torch_engine import PRECISIONS  # noqa: E402

VOCAB_IDS = 150_000


# ---------------------------------------------------------------- 1. batch assembly


def build_store(path: str, n_rollouts: int, group: int = 8, turns: int = 4, first_prompt: int = 300,
                obs: int = 200, completion: int = 100) -> TraceStore:
    rng = random.Random(0)
    store = TraceStore(f"sqlite:///{path}")
    now = time.time()
    request = {"model": "m", "messages": [{"role": "user", "content": "task " * 50}]}
    response = {"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 60}}]}
    for r in range(n_rollouts):
        rid = f"roll-{r:05d}"
        store.create_rollout(Rollout(id=rid, task_id=f"task-{r // group}", status="succeeded", created_at=now + r))
        prompt = [rng.randrange(VOCAB_IDS) for _ in range(first_prompt)]
        for t in range(turns):
            comp = [rng.randrange(VOCAB_IDS) for _ in range(completion)]
            lps = [-rng.random() for _ in range(completion)]
            store.submit_call(LLMCall(id=new_id(), rollout_id=rid, call_index=t, request=request, response=response,
                                      prompt_token_ids=tuple(prompt), completion_token_ids=tuple(comp),
                                      logprobs=tuple(lps), status_code=200, is_training=True, started_at=now,
                                      latency_s=0.01, policy_version=0))
            prompt = prompt + comp + [rng.randrange(VOCAB_IDS) for _ in range(obs)]
        store.add_reward(Reward(rollout_id=rid, value=float(rng.random() < 0.5)))
    assert store.flush(600)
    return store


def assemble(store: TraceStore, rollouts: list[Rollout], rewards: dict[str, float]):
    """The daemon's train() prefix, timed by phase."""
    t0 = time.perf_counter()
    calls = store.calls_for([r.id for r in rollouts], training_only=True)
    t1 = time.perf_counter()
    rows, stats = build_rows_for_rollouts((r, calls[r.id]) for r in rollouts)
    t2 = time.perf_counter()
    adv = rollout_advantages(rewards, {r.id: r.task_id for r in rollouts})
    rows = with_advantages(rows, adv)
    t3 = time.perf_counter()
    read = sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for cs in calls.values() for c in cs)
    return rows, stats, read, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)


def bench_assembly(n_rollouts: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        store = build_store(os.path.join(d, "bench.db"), n_rollouts)
        t_build = time.perf_counter() - t0
        rollouts = store.query_rollouts()
        rewards = {r.id: float(rr[0].value) for r in rollouts if (rr := store.rewards(r.id))}
        runs = [assemble(store, rollouts, rewards) for _ in range(repeats)]
        store.close()
    rows, stats, read, _ = runs[0]
    times = [r[3][3] for r in runs]
    phase = [statistics.median(r[3][i] for r in runs) for i in range(4)]
    tokens = sum(len(r) for r in rows)
    best = min(times)
    return dict(rollouts=n_rollouts, rows=len(rows), row_tokens=tokens, read_tokens=read, store_build_s=t_build,
                t_read=phase[0], t_rows=phase[1], t_adv=phase[2], t_total=statistics.median(times), t_best=best,
                merges=stats.merges, prefix_breaks=stats.prefix_breaks)


# ---------------------------------------------------------------- 2. training throughput and MFU


def matmul_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 3.0) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b)
    best = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


MODELS = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "qwen2-h256-l4": (256, 4, 4, 2, 1024, 16384),
    "qwen2-30M": (512, 8, 8, 2, 1408, 16384),
    # SmolLM2-135M's shape (Llama, tied), random weights: the real model the project serves on CPU.
    "smollm2-135M": (576, 30, 9, 3, 1536, 49152),
}


def make_model(d: str, name: str) -> tuple[str, int, tuple]:
    import transformers

    hidden, layers, heads, kv, inter, vocab = MODELS[name]
    llama = name.startswith("smollm2")
    config_cls = transformers.LlamaConfig if llama else transformers.Qwen2Config
    cfg = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM if llama else transformers.Qwen2ForCausalLM)(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    path = os.path.join(d, name)
    model.save_pretrained(path)
    return path, n_params, MODELS[name]


def train_rows(n_rows: int, length: int, vocab: int, prompt: int) -> list:
    from lightning_middleware.rows import Row

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n_rows):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        rows.append(Row(rollout_id=f"r{i}", task_id=f"t{i // 4}", agent=None, input_ids=tuple(ids),
                        loss_mask=tuple(mask), behaviour_logprobs=tuple(-1.0 * m for m in mask),
                        advantage=1.0 if i % 2 else -1.0))
    return rows


def bench_model_only(path: str, n_params: int, *, precision: str, n_rows: int, length: int, vocab: int,
                     micro_rows: int, steps: int) -> float:
    """MFU of the bare HF model: forward, mean token cross-entropy, backward (no engine, no optimizer)."""
    import transformers

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).train()
    ids = torch.randint(0, vocab, (n_rows, length), generator=torch.Generator().manual_seed(0))
    autocast = precision == "bf16-autocast"
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)

    def once():
        for i in range(0, n_rows, micro_rows):
            x = ids[i:i + micro_rows]
            with ctx:
                logits = model(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
        model.zero_grad(set_to_none=True)

    once()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return 6 * n_params * n_rows * length / min(times)  # FLOP/s; divided by the peak by the caller


def bench_train(path: str, n_params: int, shape: tuple, *, precision: str, steps: int, n_rows: int, length: int,
                micro_batch_tokens: int) -> dict:
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    hidden, layers, _h, _kv, _i, vocab = shape
    precision, _, compiled = precision.partition("+")  # "bf16+compile": torch.compile'd decoder layers
    eng = TorchEngine(path, TorchEngineConfig(lr=1e-5, precision=precision, micro_batch_tokens=micro_batch_tokens,
                                              compile=bool(compiled)))
    prompt = length // 4
    rows = train_rows(n_rows, length, vocab, prompt=prompt)
    eng.step(rows)  # warm-up (and compilation)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step(rows)
        times.append(time.perf_counter() - t0)
    t = min(times)  # best of: interference from other processes only slows a step down
    tokens = n_rows * length
    tps = tokens / t
    # logits only where a trained token is predicted: positions prompt-1 .. length-2 of each row
    head = vocab * hidden
    flops_6n = 6 * (n_params * tokens - head * (tokens - n_rows * (length - prompt))) / t
    attn_per_token = 12 * layers * hidden * (length / 2)
    return dict(tokens_per_s=tps, step_s=t, flops=flops_6n, flops_attn=flops_6n + attn_per_token * tps, tokens=tokens,
                precision=eng.config.precision)


# ---------------------------------------------------------------- main


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({cpu_kind()})"
    except OSError:
        pass
    return f"{platform.processor() or '?'} ({cpu_kind()})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4, help="training rows per step")
    ap.add_argument("--length", type=int, default=512, help="tokens per training row")
    ap.add_argument("--quick", action="store_true", help="smaller everything (a smoke run)")
    ap.add_argument("--models", default="qwen2-h256-l4,qwen2-30M", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--dtypes", default=None,
                    help=f"comma list of {', '.join(PRECISIONS)}, each optionally +compile (default: auto, fp32 "
                         "and, where bf16 is native, bf16-autocast, bf16, bf16+compile)")
    args = ap.parse_args()
    probe = bf16_probe()
    if args.dtypes is None:
        args.dtypes = "auto,fp32,bf16-autocast,bf16,bf16+compile" if probe.native else "auto,fp32,fp32+compile"
    dtypes = {d.removesuffix("+compile") for d in args.dtypes.split(",")}
    unknown = set(args.models.split(",")) - set(MODELS) | dtypes - set(PRECISIONS)
    if unknown:
        ap.error(f"unknown model or dtype: {', '.join(sorted(unknown))}")
    t_start = time.perf_counter()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}; "
          f"load average {os.getloadavg()[0]:.2f} (1 min)")
    print(f"bf16 probe: {probe.reason} -> auto = {resolve_precision('auto', probe=probe)}")

    a = bench_assembly(32 if args.quick else args.rollouts, 2 if args.quick else args.repeats)
    print("\n== batch assembly (SQLite store -> rows with advantages) ==")
    print(f"{a['rollouts']} rollouts x 4 calls -> {a['rows']} rows, {a['row_tokens']:,} row tokens, "
          f"{a['read_tokens']:,} token IDs read; merges {a['merges']}, prefix breaks {a['prefix_breaks']} "
          f"(store filled in {a['store_build_s']:.1f}s)")
    print(f"{'phase':<34}{'median s':>10}{'row tok/s':>14}{'read tok/s':>14}")
    for name, key in (("store.calls_for", "t_read"), ("build_rows_for_rollouts", "t_rows"),
                      ("advantages + with_advantages", "t_adv"), ("total", "t_total")):
        t = a[key]
        print(f"{name:<34}{t:>10.4f}{a['row_tokens'] / t:>14,.0f}{a['read_tokens'] / t:>14,.0f}")
    print(f"{'total (best of ' + str(args.repeats) + ')':<34}{a['t_best']:>10.4f}"
          f"{a['row_tokens'] / a['t_best']:>14,.0f}{a['read_tokens'] / a['t_best']:>14,.0f}")

    secs = 0.5 if args.quick else 1.0
    peaks: dict[str, list[float]] = {"bf16": [], "fp32": []}

    wants_bf16 = any(resolve_precision(d.partition("+")[0], probe=probe).startswith("bf16")
                     for d in args.dtypes.split(","))

    def measure_peaks() -> None:  # several rounds through the run, sizes 1024 and 2048; the best counts
        for key, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            if key == "bf16" and not wants_bf16:  # an emulated bf16 peak takes minutes and serves no mode
                peaks[key].append(float("nan"))
                continue
            peaks[key].append(max(matmul_peak(dt, n, secs) for n in (1024, 2048)))

    measure_peaks()

    n_rows, length = (4, 256) if args.quick else (args.rows, args.length)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            path, n_params, shape = make_model(d, name)
            bare: dict[str, float] = {}
            for precision in args.dtypes.split(","):
                r = bench_train(path, n_params, shape, precision=precision, steps=1 if args.quick else args.steps,
                                n_rows=n_rows, length=length, micro_batch_tokens=2048)
                base = resolve_precision(precision.partition("+")[0], probe=probe)
                if base not in bare:  # the bare model once per precision (it is never compiled)
                    bare[base] = bench_model_only(path, n_params, precision=base, n_rows=n_rows, length=length,
                                                  vocab=shape[-1], micro_rows=max(1, 2048 // length), steps=2)
                r["bare_flops"] = bare[base]
                results.append((name, n_params, precision, r))
                print(f"  measured {name} {precision}: {r['tokens_per_s']:,.0f} tok/s", flush=True)
            measure_peaks()
    peak_bf16, peak_fp32 = max(peaks["bf16"]), max(peaks["fp32"])

    print("\n== matmul peak (measured before, between and after the training runs; best) ==")
    print(f"bf16 {peak_bf16 / 1e9:,.0f} GFLOP/s   fp32 {peak_fp32 / 1e9:,.0f} GFLOP/s   "
          "(square torch.matmul 1024/2048; "
          f"runs: bf16 {', '.join(f'{p / 1e9:.0f}' for p in peaks['bf16'])}, "
          f"fp32 {', '.join(f'{p / 1e9:.0f}' for p in peaks['fp32'])})")

    print("\n== TorchEngine training (one optimizer step = 1 measurement; MFU vs the measured peak of the dtype) ==")
    print(f"batch: {n_rows} rows x {length} tokens (3/4 response), micro_batch_tokens 2048; "
          f"best of {1 if args.quick else args.steps} steps after 1 warm-up")
    print(f"{'model':<16}{'params':>9}{'mode':>15}{'tok/s':>9}{'step s':>8}{'GFLOP/s':>9}{'MFU':>7}"
          f"{'MFU+attn':>10}{'bare fwd+bwd MFU':>18}")
    for name, n_params, precision, r in results:
        used = r["precision"]
        peak = peak_fp32 if used.startswith("fp32") else peak_bf16
        mode = precision if precision.partition("+")[0] != "auto" else precision.replace("auto", f"auto={used}")
        print(f"{name:<16}{n_params / 1e6:>8.1f}M{mode:>15}"
              f"{r['tokens_per_s']:>9,.0f}{r['step_s']:>8.2f}{r['flops'] / 1e9:>9.1f}"
              f"{100 * r['flops'] / peak:>6.1f}%{100 * r['flops_attn'] / peak:>9.1f}%"
              f"{100 * r['bare_flops'] / peak:>17.1f}%")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
