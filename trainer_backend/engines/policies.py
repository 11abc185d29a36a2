"""Separate policies per agent: several LoRA adapters on one frozen base model, behind the same
`Engine` protocol the daemon drives, so the daemon itself knows nothing of policies.

    step(rows)   each policy trains on its own rows (`Row.policy`: the served model name the
                 calls went to), with its own AdamW, lr schedule and update count; one step
                 may update several policies. Rows of a model that is not one of the policies
                 go to `default` if set, else are left out (counted).
    save(out)    one adapter folder per policy, `out/<policy>/`, each loadable by vLLM; the
                 publisher loads them all in place in one pause.

`policy_version` counts the set's steps: it is what the served weights are tagged with and what
rollouts are stamped with, so staleness is in steps, as with one policy. Each policy's own
update count is in its metrics (`<policy>/updates`).

The base is loaded once; the engines share one peft model and switch the active adapter (the
others are frozen while one trains). The reference for KL and DPO is the base, every adapter off.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_middleware.rows import Row
from trainer_backend.engines import lora
from trainer_backend.engines.torch_config import TorchEngineConfig
from trainer_backend.engines.torch_engine import TorchEngine

log = logging.getLogger(__name__)

# how each policy's metric becomes the step's: the worst (health checks look at it), the sum, else the mean
_WORST = ("grad_norm", "approx_kl", "kl_ref", "ratio_max", "clip_frac", "clip_frac_lower", "behaviour_logprob_gap")
_SUMMED = ("rows", "rollouts", "micro_batches", "tokens", "padded_tokens", "response_tokens", "time_s", "pairs")


class PolicySet:
    """LoRA policies `names` on the base in `model_dir`, or resumed from a checkpoint of them."""

    def __init__(self, model_dir: str | Path, names: Sequence[str], config: TorchEngineConfig, *,
                 default: str | None = None, device: str = "cpu", policy_version: int = 0) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"policies must be distinct names, got {list(names)}")
        if default is not None and default not in names:
            raise ValueError(f"default policy {default!r} is not one of {list(names)}")
        root = Path(model_dir)
        model, base_dir, resumed = lora.load_set(root, names, config.lora or lora.AdapterConfig(), dtype=torch.float32)
        self.names, self.default = tuple(names), default
        self.base_dir = base_dir
        self.policy_version = policy_version
        self.engines = {
            name: TorchEngine(root / name if resumed else base_dir, config, device=device,
                              policy_version=policy_version, shared=lora.SharedAdapter(model, name, base_dir))
            for name in names
        }
        log.info("policy set %s on %s (%s)", ", ".join(names), base_dir, "resumed" if resumed else "new adapters")

    def route(self, rows: Sequence[Row]) -> dict[str, list[Row]]:
        """Rows by the policy that trains them (rows of no policy, without a default, are left out)."""
        out: dict[str, list[Row]] = {}
        for row in rows:
            name = row.policy if row.policy in self.engines else self.default
            if name is not None:
                out.setdefault(name, []).append(row)
        return out

    def step(self, rows: Sequence[Row]) -> dict[str, float]:
        routed = self.route(rows)
        if not routed:
            raise ValueError(f"no row belongs to a policy of {list(self.names)} (rows' models: "
                             f"{sorted({str(r.policy) for r in rows})}) and there is no default policy")
        per_policy = {name: self.engines[name].step(policy_rows) for name, policy_rows in routed.items()}
        self.policy_version += 1
        metrics = _combine(per_policy)
        for name, m in per_policy.items():
            metrics.update({f"{name}/{k}": v for k, v in m.items()})
            metrics[f"{name}/updates"] = float(self.engines[name].scheduler.last_epoch)
        metrics["policies_updated"] = float(len(per_policy))
        metrics["rows_unrouted"] = float(len(rows) - sum(len(r) for r in routed.values()))
        metrics["policy_version"] = float(self.policy_version)
        return metrics

    @property
    def lr(self) -> float:
        """The current learning rate (every policy follows one schedule)."""
        return next(iter(self.engines.values())).lr

    def set_lr(self, lr: float) -> None:
        for engine in self.engines.values():
            engine.set_lr(lr)

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        for name, engine in self.engines.items():
            engine.save(out / name)
        return out


def _combine(per_policy: dict[str, dict[str, float]]) -> dict[str, float]:
    keys = set.intersection(*(set(m) for m in per_policy.values()))
    out = {}
    for k in keys:
        values = [m[k] for m in per_policy.values() if isinstance(m[k], (int, float)) and not math.isnan(m[k])]
        if not values:
            continue
        out[k] = max(values) if k in _WORST or k.endswith("_max") else sum(values) if k in _SUMMED \
            else sum(values) / len(values)
    return out
