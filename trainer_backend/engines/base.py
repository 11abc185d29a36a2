"""The small interfaces the trainer daemon drives: a training engine and a weight publisher.

Light on purpose (no torch): the daemon and its CLI import this, and each engine
(`torch_engine.TorchEngine`, `verl_engine.VerlEngine`) satisfies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_middleware.rows import Row


@runtime_checkable
class Engine(Protocol):
    """Trains on rows whose advantages are set; one `step` is one optimizer update."""

    policy_version: int

    def step(self, rows: Sequence[Row]) -> dict[str, float]: ...

    def save(self, out_dir: str | Path) -> Path: ...


@runtime_checkable
class RoutesRows(Protocol):
    """An engine of several policies: which policy trains which rows. The daemon computes
    advantages per policy (groups of one task and one policy) when its engine has this."""

    def route(self, rows: Sequence[Row]) -> dict[str, list[Row]]: ...


class Publisher(Protocol):
    """Puts a saved checkpoint into the serving engine (see trainer_backend.serving.publisher)."""

    def publish(self, checkpoint_dir: str | Path, version: int) -> Any: ...
