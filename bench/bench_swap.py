"""Measure server startup and hot-swap timings on a real vLLM server.

    python bench/bench_swap.py tiny            # tiny tied model built on the fly
    python bench/bench_swap.py smollm2 DIR     # a converted SmolLM2 folder

Prints one JSON object (CLI output). Runs in the trainer env (torch+transformers
to build variants and to check logprobs against an HF forward pass).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from trainer_backend.models import build_tiny_model, reinit_weights
from trainer_backend.serving.publisher import WeightPublisher
from trainer_backend.serving.server import VLLMServer

MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def hf_max_diff(ckpt: Path, out: dict) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    p, c = out["prompt_token_ids"], out["choices"][0]["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([p + c])).logits[0]
    logp = torch.log_softmax(logits[len(p) - 1 : -1].float(), -1).gather(1, torch.tensor(c)[:, None])[:, 0]
    got = [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]
    return max(abs(a - b) for a, b in zip(got, logp.tolist()))


def decode_rate(base_url: str, concurrency: int, tokens: int = 64, rounds: int = 3) -> float:
    """Completion tokens per second with `concurrency` requests in flight (sampling at T=1)."""
    body = {"model": "m", "messages": MSGS, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}

    def one(_: int) -> int:
        r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(concurrency)))  # warm up
        t0 = time.perf_counter()
        done = sum(pool.map(one, range(concurrency * rounds)))
    return round(done / (time.perf_counter() - t0), 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=("tiny", "smollm2"))
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--swaps", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    base = Path(args.model_dir) if args.model_dir else build_tiny_model(tmp / "base", tie_word_embeddings=True)
    variants = [base, reinit_weights(base, tmp / "v1", seed=1)]
    with VLLMServer(base, dtype="float32", served_model_name="m", log_path=tmp / "server.log") as server:
        pub = WeightPublisher(server.url)
        results = [pub.publish(variants[(i + 1) % 2], f"v{i}") for i in range(args.swaps)]
        body = {"model": "m", "messages": MSGS, "max_tokens": 16, "temperature": 0,
                "logprobs": True, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
        t0 = time.perf_counter()
        out = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300).json()
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()  # second request: the first after a swap pays one-off costs
        httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300).raise_for_status()
        gen_s = time.perf_counter() - t0
        last = variants[args.swaps % 2]
        throughput = {f"tokens_per_s_concurrency_{c}": decode_rate(server.base_url, c) for c in (1, 8)}
        report = {
            "model": args.model,
            "startup_s": round(server.startup_s or 0, 2),
            "swaps": args.swaps,
            "all_verified": all(r.verified for r in results),
            "median_s": {k: round(statistics.median(getattr(r, k) for r in results), 4) for k in (
                "engine_pause_s", "reload_s", "worker_reload_s", "worker_repack_s",
                "reset_cache_s", "tag_s", "resume_s", "paused_s", "total_s")},  # fmt: skip
            "max_lm_head_probe_err": max(r.lm_head_max_err or 0 for r in results),
            "first_after_swap_s": round(first_s, 3),
            "greedy_16_tokens_s": round(gen_s, 3),
            "max_abs_logprob_diff_vs_hf": hf_max_diff(last, out),
            **throughput,
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
