"""Framework adapters: each finds the HTTP client(s) a framework really sends through.

An adapter module exposes `http_clients(obj) -> list | None`: the httpx/httpx2
clients to record for `obj`, or None if `obj` is not its framework's. Adapters
import their framework lazily, so importing this package costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

# (prefix of the object's type module, adapter module). Filled by the adapters issue.
_ADAPTERS: list[tuple[str, str]] = []


def resolve(obj: Any) -> list[Any] | None:
    """The HTTP clients behind a framework object, or None if no adapter knows it."""
    type_module = type(obj).__module__ if not isinstance(obj, type(importlib)) else obj.__name__
    for prefix, module_name in _ADAPTERS:
        if type_module.startswith(prefix):
            adapter = importlib.import_module(module_name)
            found = adapter.http_clients(obj)
            if found is not None:
                return found
    return None
