"""Task sets: a JSONL file, a list of dicts or a `datasets.Dataset`, each task with a unique id."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

# A JSONL path, or dicts (a list, a generator, a `datasets.Dataset`).
TaskSource = str | os.PathLike[str] | Iterable[dict[str, Any]]


def load_tasks(tasks: TaskSource, *, task_id_key: str = "task_id") -> list[tuple[str, dict[str, Any]]]:
    """(task_id, task) pairs from a JSONL path, a list of dicts, or a `datasets.Dataset`.

    The task id is `task[task_id_key]`, else `task["id"]`, else "task-<index>".
    """
    if isinstance(tasks, (str, os.PathLike)):
        rows: Iterable[Any] = []
        with open(tasks, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = tasks
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            row = dict(row)
        tid = row.get(task_id_key)
        if tid is None:
            tid = row.get("id")
        tid = f"task-{i}" if tid is None else str(tid)
        if tid in seen:
            raise ValueError(f"duplicate task id {tid!r}: task ids name GRPO groups and must be unique")
        seen.add(tid)
        out.append((tid, row))
    return out
