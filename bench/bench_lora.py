"""LoRA against full weights, side by side in one run: the vLLM engine's pause to swap a new
policy in (an adapter loaded in place vs a full-weight reload) and the torch engine's training
tokens/s, on the tiny model and on SmolLM2-135M's shape (random weights, no download).

    .venv/bin/python bench/bench_lora.py                      # both models, 5 swaps each
    .venv/bin/python bench/bench_lora.py --models tiny --swaps 3

Prints a table and one JSON line. The pause is `PublishResult.paused_s`: engine paused -> resumed,
what requests in flight feel; its parts (the reload or adapter load, the prefix-cache reset, the
version tag, the resume) are reported as medians too. Each swap publishes a different checkpoint
(alternating two). ~6 minutes on the 2-core machine when it is quiet, mostly the 135M training.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# trainer_backend before torch: importing it makes torch's OpenMP threads wait passively
import trainer_backend  # noqa: E402,F401

# isort: split
import torch  # noqa: E402

from trainer_backend.engines.lora import AdapterConfig  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from trainer_backend.models import build_tiny_model, reinit_weights  # noqa: E402
from trainer_backend.serving.publisher import WeightPublisher  # noqa: E402
from trainer_backend.serving.server import VLLMServer  # noqa: E402

RANK = 16


def smollm2_shape(out: Path) -> Path:
    """SmolLM2-135M's shape (Llama, tied, vocab 49,152), random weights, with the tiny tokenizer's files
    (vLLM needs a tokenizer; the token IDs here stay below its size)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    tiny = build_tiny_model(out.parent / "tok-src", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny / name).is_file():
            (out / name).write_bytes((tiny / name).read_bytes())
    return out


def _rows(vocab: int, n: int = 4, length: int = 512):
    from lightning_middleware.rows import Row

    g = torch.Generator().manual_seed(0)
    prompt = length // 4
    return [Row(rollout_id=f"r{i}", task_id="t", agent=None,
                input_ids=tuple(torch.randint(0, min(vocab, 2000), (length,), generator=g).tolist()),
                loss_mask=(0,) * prompt + (1,) * (length - prompt), behaviour_logprobs=None,
                advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def train_rate(model_dir: Path, vocab: int, adapter: AdapterConfig | None, precision: str, steps: int = 3) -> float:
    eng = TorchEngine(model_dir, TorchEngineConfig(lr=1e-5, precision=precision, lora=adapter,
                                                   old_logprobs="recompute", micro_batch_tokens=2048))
    rows = _rows(vocab)
    eng.step(rows)  # warm-up
    best = min(_timed(lambda: eng.step(rows)) for _ in range(steps))
    return sum(len(r) for r in rows) / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def swap_pauses(model_dir: Path, variants: list[Path], adapters: list[Path], swaps: int, d: Path,
                startup_timeout: float) -> dict:
    server = VLLMServer(model_dir, served_model_name="base", dtype="float32", max_lora_rank=RANK, max_loras=2,
                        log_path=d / f"vllm-{model_dir.name}.log", startup_timeout=startup_timeout)
    with server:
        full = WeightPublisher(server.url)
        lora = WeightPublisher(server.url, adapter_name="policy")
        lora.publish(adapters[0], 0)  # first load (not in place) left out of the figures
        full_r = [full.publish(variants[i % 2], 100 + i) for i in range(swaps)]
        lora_r = [lora.publish(adapters[i % 2], 200 + i) for i in range(swaps)]
        full.publish(model_dir, 999)
    out: dict = {"startup_s": server.startup_s}
    for label, results in (("full", full_r), ("lora", lora_r)):
        out[f"{label}_ms"] = _median_ms(results, "paused_s")
        out[f"{label}_all_ms"] = [round(1e3 * r.paused_s, 1) for r in results]
        # what the pause is made of; engine_pause_s (waiting for the engine to pause) comes before it
        out[f"{label}_parts_ms"] = {part: round(_median_ms(results, f"{part}_s"), 2)
                                    for part in ("engine_pause", "reload", "reset_cache", "tag", "resume",
                                                 "worker_reload", "stage")}
    return out


def _median_ms(results: list, field: str) -> float:
    return 1e3 * statistics.median(getattr(r, field) for r in results)


def adapters_for(model_dir: Path, d: Path, vocab: int) -> list[Path]:
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        eng = TorchEngine(model_dir, TorchEngineConfig(lr=1e-2, precision="fp32", lora=AdapterConfig(rank=RANK),
                                                       old_logprobs="recompute"))
        eng.step(_rows(vocab, n=2, length=64))  # B != 0: the adapter changes the outputs
        out.append(eng.save(d / f"{model_dir.name}-adapter{seed}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,smollm2-135M")
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=3, help="timed training steps per cell (best of)")
    # The 135M server's worker took 3.5 min to start at load 17 on the 2-core machine (300 s: too short).
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kinds = sorted(set(os.popen("grep -o 'avx512_bf16\\|avx2' /proc/cpuinfo").read().split()))
    print(f"CPU flags: {', '.join(kinds)}; torch threads {torch.get_num_threads()}; OMP_WAIT_POLICY"
          f" {os.environ.get('OMP_WAIT_POLICY')}; load {os.getloadavg()[0]:.2f}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name in args.models.split(","):
            base = build_tiny_model(d / name, seed=0) if name == "tiny" else smollm2_shape(d / name)
            vocab = json.loads((base / "config.json").read_text())["vocab_size"]  # the tiny tokenizer's may be < 2048
            variants = [reinit_weights(base, d / f"{name}-v{i}", seed=10 + i) for i in (1, 2)]
            res = swap_pauses(base, variants, adapters_for(base, d, vocab), args.swaps, d, args.startup_timeout)
            for label, adapter in (("full", None), ("lora", AdapterConfig(rank=RANK))):
                for precision in ("fp32", "auto"):
                    res[f"train_{label}_{precision}_tok_s"] = train_rate(base, vocab, adapter, precision,
                                                                         args.train_steps)
            results[name] = res
            r = {k: round(v) for k, v in res.items() if k.startswith("train_")}
            res["load_after"] = round(os.getloadavg()[0], 2)
            print(f"{name:14s} swap pause: full reload {res['full_ms']:7.1f} ms, adapter {res['lora_ms']:6.1f} ms"
                  f" | train tok/s fp32: full {r['train_full_fp32_tok_s']}, lora {r['train_lora_fp32_tok_s']};"
                  f" auto: full {r['train_full_auto_tok_s']}, lora {r['train_lora_auto_tok_s']}"
                  f" | load {res['load_after']}", flush=True)
            print(f"{'':14s} parts (ms): full {res['full_parts_ms']}; adapter {res['lora_parts_ms']}", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
