"""Offline DPO from a preference file: `lightning-mw dpo --data prefs.jsonl --model DIR --out DIR`.

The file is what `lightning-mw export --kind preferences` writes (JSONL, one pair a line):
`chosen_input_ids` / `chosen_loss_mask` and `rejected_input_ids` / `rejected_loss_mask` (the
token IDs the engine sampled, masks 1 on sampled tokens), plus an `id`. Each pair becomes two
rows labelled +1 / -1 and keyed by the pair id; the torch engine's DPO step trains on
`pairs_per_step` pairs at a time against the frozen start weights, for `epochs` passes in a
seeded shuffled order, and saves the final weights (HF format, loadable by vLLM) to `out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_middleware.errors import UsageError
from lightning_middleware.rows import Row

if TYPE_CHECKING:  # torch: imported when training starts, not when the CLI registers `dpo`
    from trainer_backend.algorithms.losses import DPOConfig

log = logging.getLogger(__name__)

FIELDS = ("chosen_input_ids", "chosen_loss_mask", "rejected_input_ids", "rejected_loss_mask")


class PreferenceFileError(UsageError, ValueError):
    """A preference file that cannot be read; the message names the line and the field."""


def _side(rec: dict[str, Any], side: str, key: str) -> Row:
    ids, mask = rec[f"{side}_input_ids"], rec[f"{side}_loss_mask"]
    if not (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask) and any(mask)):
        raise ValueError(f"{side}: input_ids and loss_mask must be lists of one length with a masked token")
    return Row(rollout_id=f"{key}:{side}", task_id=key, agent=None, input_ids=tuple(int(t) for t in ids),
               loss_mask=tuple(int(m) for m in mask), behaviour_logprobs=None,
               advantage=1.0 if side == "chosen" else -1.0)


def preference_rows(path: str | Path) -> list[Row]:
    """Two rows per pair of the file (chosen, rejected), in file order."""
    rows: list[Row] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise PreferenceFileError(f"cannot read the preference file {path}: {exc.strerror or exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            missing = [f for f in FIELDS if f not in rec]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            key = str(rec.get("id", n))
            rows += [_side(rec, "chosen", key), _side(rec, "rejected", key)]
        except (ValueError, TypeError) as exc:
            raise PreferenceFileError(f"{Path(path).name} line {n}: {exc}") from None
    if not rows:
        raise PreferenceFileError(f"{path} holds no preference pairs")
    return rows


@dataclass(frozen=True)
class OfflineResult:
    steps: int
    pairs: int
    out: Path
    metrics: list[dict[str, float]] = field(default_factory=list)


def train_offline_dpo(data: str | Path, model_dir: str | Path, out: str | Path, *, config: DPOConfig | None = None,
                      lr: float = 1e-6, pairs_per_step: int = 8, epochs: int = 1, seed: int = 0,
                      precision: str = "auto", micro_batch_tokens: int = 8192) -> OfflineResult:
    """Train DPO on the file's pairs and save the result to `out`."""
    from trainer_backend.algorithms.losses import DPOConfig
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    rows = preference_rows(data)
    by_pair: dict[str, list[Row]] = {}
    for r in rows:
        by_pair.setdefault(str(r.task_id), []).append(r)
    engine = TorchEngine(model_dir, TorchEngineConfig(lr=lr, dpo=config or DPOConfig(), precision=precision,
                                                      micro_batch_tokens=micro_batch_tokens))
    rng = random.Random(seed)
    history: list[dict[str, float]] = []
    keys = list(by_pair)
    for epoch in range(epochs):
        rng.shuffle(keys)
        for start in range(0, len(keys), pairs_per_step):
            step_rows = [r for k in keys[start:start + pairs_per_step] for r in by_pair[k]]
            metrics = engine.step(step_rows)
            history.append(metrics)
            log.info("epoch %d step %d: loss %.4f, accuracy %.2f, margin %+.4f", epoch + 1, len(history),
                     metrics["dpo_loss"], metrics["rewards_accuracies"], metrics["rewards_margins"])
    saved = engine.save(out)
    return OfflineResult(steps=len(history), pairs=len(keys), out=saved, metrics=history)


def add_cli(sub: Any) -> None:
    p = sub.add_parser("dpo", help="offline DPO on a preference file (from lightning-mw export --kind preferences)")
    p.add_argument("--data", required=True, help="the preference JSONL")
    p.add_argument("--model", required=True, help="the model to start from and to stay near (HF folder)")
    p.add_argument("--out", required=True, help="where to save the trained model")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta (default 0.1)")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="conservative DPO's label noise (default 0)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--pairs-per-step", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto", help="auto | fp32 | bf16 | bf16-autocast")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not Path(args.model).is_dir():
        raise UsageError(f"--model: no model folder at {args.model}")
    if not 0 <= args.label_smoothing < 0.5 or args.beta <= 0 or args.pairs_per_step < 1 or args.epochs < 1:
        raise UsageError("need beta > 0, 0 <= label-smoothing < 0.5, pairs-per-step >= 1, epochs >= 1")
    from trainer_backend.algorithms.losses import DPOConfig

    result = train_offline_dpo(args.data, args.model, args.out,
                               config=DPOConfig(beta=args.beta, label_smoothing=args.label_smoothing), lr=args.lr,
                               pairs_per_step=args.pairs_per_step, epochs=args.epochs, seed=args.seed,
                               precision=args.precision)
    last = result.metrics[-1]
    print(f"{result.pairs} pairs, {result.steps} steps: loss {last['dpo_loss']:.4f}, accuracy "
          f"{last['rewards_accuracies']:.2f}, margin {last['rewards_margins']:+.4f}; saved {result.out}")
    return 0
