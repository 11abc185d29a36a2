"""Protected files: what the harness hashes before an episode and checks after it, so that a
policy that edits the tests (or fixtures, or the grader) instead of fixing the code is caught by
the `protected_files` guard even when no tool call shows it (a script the agent wrote did it).

    guard = ProtectedFiles(["tests/", "conftest.py"], root=repo)   # before the agent runs
    with rollout("bug-7", rewards=config) as r:
        run_agent(repo)
        guard.report(r)                                            # before the block ends

`report` stores a reward named "protected_files" (not final): the number of changed, added or
deleted files, with their paths in the metadata; the guard reads it from the stored rollout.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from lightning_middleware.rewards.trajectory import PROTECTED

log = logging.getLogger(__name__)


class _Rewardable(Protocol):
    def reward(self, value: float, *, name: str | None = None, final: bool | None = None,
               metadata: dict[str, object] | None = None) -> None: ...


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ProtectedFiles:
    """A snapshot of the files under `paths` (files, or directories walked recursively),
    relative to `root`, taken at construction."""

    def __init__(self, paths: Iterable[str | os.PathLike[str]], *, root: str | os.PathLike[str] = ".") -> None:
        self.root = Path(root).resolve()
        self.paths = [Path(p) for p in paths]
        self.before = self.snapshot()

    def _files(self) -> Iterable[Path]:
        for p in self.paths:
            full = p if p.is_absolute() else self.root / p
            if full.is_dir():
                yield from (f for f in full.rglob("*") if f.is_file())
            elif full.is_file():
                yield full

    def snapshot(self) -> dict[str, str]:
        """Relative path -> sha256 of every protected file now."""
        out = {}
        for f in self._files():
            try:
                out[str(f.resolve().relative_to(self.root))] = _digest(f)
            except (OSError, ValueError):  # unreadable, or outside root: named by its full path
                out[str(f)] = "unreadable"
        return out

    def changed(self) -> list[str]:
        """The protected files changed, added or deleted since the snapshot, sorted."""
        after = self.snapshot()
        return sorted(k for k in self.before.keys() | after.keys() if self.before.get(k) != after.get(k))

    def report(self, handle: _Rewardable) -> list[str]:
        """Store the verdict on the rollout (`handle`: its `RolloutHandle`) and return the changed files."""
        changed = self.changed()
        if changed:
            log.warning("%d protected files changed during the episode: %s", len(changed), changed[:5])
        meta: dict[str, object] = {"changed": changed, "protected": len(self.before)}
        handle.reward(float(len(changed)), name=PROTECTED, final=False, metadata=meta)
        return changed
