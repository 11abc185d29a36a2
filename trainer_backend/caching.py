"""Where the project caches what is slow to build, and one builder at a time per cache folder,
across processes.

The demos cache what is slow to build (the converted SmolLM2, the SFT warm starts) under
$LIGHTNING_HOME. Two runs on one machine (two seeds side by side, or test workers) that miss the
same cache at once would both build it and race to rename their results into place; with the
lock, the second waits and then finds the first one's folder.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def lightning_home() -> Path:
    """Root folder for the project's caches (``$LIGHTNING_HOME``): the vLLM environment, models,
    warm starts, hardware probes, logs."""
    default = Path.home() / ".cache" / "lightning-middleware"
    return Path(os.environ.get("LIGHTNING_HOME", default)).expanduser()


@contextmanager
def build_lock(folder: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on `folder`'s sibling `<name>.lock` (released when the process dies)."""
    path = Path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish building %s", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_once(folder: str | os.PathLike[str], marker: str, build: Callable[[], object]) -> Path:
    """`folder`, built by `build()` unless it holds `marker` (the file a finished build writes last);
    checked again under the lock, since another process may have built it while this one waited."""
    path = Path(folder)
    if not (path / marker).exists():
        with build_lock(path):
            if not (path / marker).exists():
                build()
    return path
