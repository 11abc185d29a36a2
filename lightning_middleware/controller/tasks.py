"""Task sets: a JSONL file, a list of dicts, a `datasets.Dataset`, or a benchmark's address
(`rg:NAME?size=N&seed=S`: reasoning-gym; `bfcl:CATEGORY?split=test`: BFCL;
`lightning_middleware.benchmarks`), each task with a unique id."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from lightning_middleware import benchmarks
from lightning_middleware.errors import UsageError

# A JSONL path, or dicts (a list, a generator, a `datasets.Dataset`).
TaskSource = str | os.PathLike[str] | Iterable[dict[str, Any]]


class TaskFileError(UsageError, ValueError):
    """A task set that can't be read: a missing file, a line that is not a JSON object, a duplicate id."""


def load_tasks(tasks: TaskSource, *, task_id_key: str = "task_id",
               timeout_key: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(task_id, task) pairs from a JSONL path, a list of dicts, or a `datasets.Dataset`.

    The task id is `task[task_id_key]`, else `task["id"]`, else "task-<index>". `timeout_key`: a
    task's own rollout timeout, checked here (a positive number of seconds) so that a bad one stops
    the run before any rollout starts.
    """
    if benchmarks.is_address(tasks):
        tasks = benchmarks.tasks_from(str(tasks))
    rows: Iterable[Any] = _read_jsonl(tasks) if isinstance(tasks, (str, os.PathLike)) else tasks
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            try:
                row = dict(row)
            except (TypeError, ValueError):
                raise TaskFileError(f"task {i} is not an object: {row!r:.80}") from None
        tid = row.get(task_id_key)
        if tid is None:
            tid = row.get("id")
        tid = f"task-{i}" if tid is None else str(tid)
        if tid in seen:
            raise TaskFileError(f"duplicate task id {tid!r}: task ids name GRPO groups and must be unique")
        seen.add(tid)
        if timeout_key is not None and row.get(timeout_key) is not None:
            value = row[timeout_key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise TaskFileError(f"task {tid!r}: {timeout_key} must be a positive number of seconds, "
                                    f"got {value!r:.40}")
        out.append((tid, row))
    return out


def task_timeout(task: dict[str, Any], timeout_key: str | None, default: float | None) -> float | None:
    """The rollout timeout of `task`: its own `timeout_key` value where it has one (long tasks
    beside short ones in one run), else the controller's `default`."""
    own = task.get(timeout_key) if timeout_key is not None else None
    return default if own is None else float(own)


def _read_jsonl(path: str | os.PathLike[str]) -> list[Any]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except OSError as exc:
        raise TaskFileError(f"cannot read the task file {os.fspath(path)!r}: {exc.strerror or exc}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            raise TaskFileError(f"{os.fspath(path)}, line {n}: not JSON ({exc})") from None
        if not isinstance(rows[-1], dict):
            raise TaskFileError(f"{os.fspath(path)}, line {n}: a task is a JSON object, got {line.strip()[:60]}")
    return rows
