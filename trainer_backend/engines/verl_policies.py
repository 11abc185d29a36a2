"""Separate LoRA policies on the verl engine: one verl LoRA engine per policy, behind the same
multi-policy surface as the torch engine's `PolicySet` (`engines/policy_set.py`).

verl 0.9.1's FSDP engine holds one adapter, "default", and reads that one everywhere downstream
(see `verl_lora`), so each policy is its own `VerlEngine`: verl's own LoRA, its own adapter,
its own AdamW, lr schedule and checkpoint state. The cost is one copy of the base model per
policy (measured in docs/policies.md).

Several engines live in one process or on one GPU set: verl's worker joins the process group
that exists (`initialize_global_process_group_ray` only initialises one when none is), each
engine wraps its own module in FSDP over its own device mesh, and nothing else of the actor is
global in verl with sequence parallelism off. On Ray the policies' worker groups share one
resource pool with `max_colocate_count` = the number of policies (verl's way of putting several
worker groups, one process each, on the same GPUs), so two policies need no more GPUs than one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainer_backend.engines import lora
from trainer_backend.engines.policy_set import MultiPolicy, check_names
from trainer_backend.engines.verl_engine import VerlEngine, VerlEngineConfig, ray_workers

log = logging.getLogger(__name__)

StartWorkers = Callable[[Any, VerlEngineConfig], Any]


def shared_pool_workers(config: VerlEngineConfig, n_policies: int) -> StartWorkers:
    """`start_workers` for every policy's engine: Ray worker groups on one resource pool, colocated."""
    from verl.single_controller.ray import RayResourcePool

    pool = RayResourcePool(process_on_nodes=[config.n_gpus] * config.nnodes, use_gpu=True,
                           max_colocate_count=n_policies)
    return functools.partial(ray_workers, pool=pool)


class VerlPolicySet(MultiPolicy):
    """LoRA policies `names`, each a `VerlEngine`: new adapters on the model in `model_dir`, or
    resumed (adapter and verl's optimizer state) from `model_dir/<name>/` when all exist."""

    def __init__(self, model_dir: str | Path, names: Sequence[str], config: VerlEngineConfig, *,
                 default: str | None = None, policy_version: int = 0, work_dir: str | Path | None = None,
                 start_workers: StartWorkers | None = None) -> None:
        check_names(names, default)
        if config.lora is None:
            raise ValueError("separate policies are LoRA adapters: set VerlEngineConfig.lora")
        root = Path(model_dir)
        resumed = all(lora.is_adapter_dir(root / n) for n in names)
        start = start_workers or shared_pool_workers(config, len(names))
        work = Path(work_dir) if work_dir else Path("runs/verl_work")
        self.names, self.default, self.policy_version = tuple(names), default, policy_version
        self.engines: dict[str, VerlEngine] = {
            # a work folder per policy: verl's checkpoint of each engine is named by its step
            name: VerlEngine(root / name if resumed else root, config, policy_version=policy_version,
                             work_dir=work / name, start_workers=start)
            for name in names
        }
        self.base_dir = next(iter(self.engines.values())).base_dir
        self._updates = {name: _saved_updates(root / name) if resumed else 0 for name in names}
        log.info("verl policy set %s on %s (%s)", ", ".join(names), self.base_dir,
                 "resumed" if resumed else "new adapters")

    def updates(self, name: str) -> int:
        return self._updates[name]

    def stepped(self, name: str) -> None:
        self._updates[name] += 1

    def save(self, out_dir: str | Path) -> Path:
        out = super().save(out_dir)
        for name in self.names:
            (out / name / UPDATES_FILE).write_text(f"{self._updates[name]}\n")
        return out


UPDATES_FILE = "policy_updates.txt"  # the policy's own update count (the set's version counts steps)


def _saved_updates(adapter_dir: Path) -> int:
    path = adapter_dir / UPDATES_FILE
    return int(path.read_text()) if path.is_file() else 0

