"""A GRPO step with and without shared prefixes (TorchEngineConfig.share_prefixes), side by side.

The step is shaped like `lightning-mw demo --task bfcl`'s: G groups of K rows, each group on its
own prompt (BFCL's tool documents and question, ~400 tokens), completions of 30-70 tokens; the
engine as the demo configures it (fp32, activation budget 2,048 MB). Rounds alternate the two
settings so that the machine's load falls on both alike; the median step time of each is reported
with the tokens the decoder computed, and the largest difference between their log-probs.
`--store` takes a step's rows from a demo's trace store instead (its first `--groups` full groups of
train rollouts, as the daemon builds them): the real token shapes of that task.

    python bench/bench_shared_prefix.py [--model DIR] [--groups 4] [--group-size 4] [--prompt 410] [--rounds 3]
    python bench/bench_shared_prefix.py --store sqlite:///runs/demo-bfcl/traces.db
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lightning_middleware import TraceStore  # noqa: E402
from lightning_middleware.records import Rollout  # noqa: E402
from lightning_middleware.rows import Row, build_rows_for_rollouts, with_advantages  # noqa: E402
from trainer_backend.engines.precision import cpu_kind  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

SMOL = Path.home() / ".cache/lightning-middleware/models/smollm2-135m-instruct"


def step_rows(groups: int, size: int, prompt: int, vocab: int, seed: int = 0) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        head = [rng.randrange(vocab) for _ in range(prompt + rng.randrange(-40, 40))]
        for k in range(size):
            completion = [rng.randrange(vocab) for _ in range(rng.randrange(30, 70))]
            n = len(head) + len(completion)
            mask = (0,) * len(head) + (1,) * len(completion)
            rows.append(Row(rollout_id=f"g{g}r{k}", task_id=f"g{g}", agent=None, input_ids=tuple(head + completion),
                            loss_mask=mask, behaviour_logprobs=tuple(-1.0 * m for m in mask),
                            advantage=rng.choice((-1.0, 1.0)), temperature=(1.0,) * n))
    return rows


def recorded_rows(url: str, groups: int, size: int) -> list[Row]:
    """The rows of the store's first `groups` train groups of `size` rollouts, with +-1 advantages."""
    store = TraceStore(url)
    by_task: dict[str, list[Rollout]] = {}
    for r in store.query_rollouts(mode="train", status=["succeeded"]):
        by_task.setdefault(r.task_id, []).append(r)
    chosen = [r for members in [m for m in by_task.values() if len(m) >= size][:groups] for r in members[:size]]
    if len(chosen) < groups * size:
        raise SystemExit(f"{url}: fewer than {groups} train groups of {size} succeeded rollouts")
    calls = store.calls_for([r.id for r in chosen], training_only=True)
    rows, _ = build_rows_for_rollouts((r, calls[r.id]) for r in chosen)
    store.close()
    return with_advantages(rows, {r.id: (-1.0) ** k for k, r in enumerate(chosen)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(SMOL))
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=410)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--store", default=None, help="a demo's trace store: its recorded rows instead of made-up ones")
    a = ap.parse_args()
    engines = {share: TorchEngine(a.model, TorchEngineConfig(lr=1e-5, precision=a.precision, share_prefixes=share,
                                                             freeze_embeddings=True, activation_budget_mb=2048))
               for share in (False, True)}
    vocab = engines[True].model.config.vocab_size
    rows = (recorded_rows(a.store, a.groups, a.group_size) if a.store
            else step_rows(a.groups, a.group_size, a.prompt, vocab))
    shape = (f"{len(rows)} rows from {a.store}, {sum(len(r) for r in rows)} tokens" if a.store
             else f"{a.groups} groups x {a.group_size} rows, prompt ~{a.prompt}")
    gap = max(abs(x - y) for r1, r2 in zip(engines[False].token_logprobs(rows), engines[True].token_logprobs(rows))
              for x, y in zip(r1, r2))
    times: dict[bool, list[float]] = {False: [], True: []}
    metrics: dict[bool, dict[str, float]] = {}
    for _ in range(a.rounds):
        for share in (False, True):
            t0 = time.perf_counter()
            metrics[share] = engines[share].step(rows)
            times[share].append(time.perf_counter() - t0)
    print(f"CPU: {cpu_kind()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
          f"{shape}, {a.precision}, {a.rounds} rounds")
    print(f"max |log-prob difference| before any step: {gap:.2e}")
    for share in (False, True):
        m = metrics[share]
        print(f"share_prefixes={share!s:5}  step {statistics.median(times[share]):6.1f} s (runs "
              f"{', '.join(f'{t:.1f}' for t in times[share])})  decoded tokens {m['decoded_tokens']:.0f}  "
              f"padded {m['padded_tokens']:.0f}  micro-batches {m['micro_batches']:.0f}")
    print(f"ratio plain / shared: {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")


if __name__ == "__main__":
    main()
