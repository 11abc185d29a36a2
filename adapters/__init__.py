"""Framework adapters: each finds the HTTP client(s) a framework really sends through.

An adapter module exposes `http_clients(obj) -> list | None`: the httpx/httpx2
clients to record for `obj`, or None if `obj` is not its framework's. Adapters
import their framework lazily, so importing this package costs nothing.

An adapter may also expose `install_hooks()`: idempotent, process-wide hooks
that name the agent making each call (`LLMCall.agent_name`) or keep objects the
framework rebuilds recording. `prepare()` runs them for every framework that is
already imported, so they are in place even when the user wraps a plain
`openai` client and hands it to the framework (Agents SDK, LiteLLM).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

# (prefix of the object's type module, adapter module).
_ADAPTERS: list[tuple[str, str]] = [
    ("langchain_openai", "adapters.langchain"),
    ("langchain_core", "adapters.langchain"),
    ("autogen_ext", "adapters.autogen"),
    ("autogen_agentchat", "adapters.autogen"),
    ("adapters.autogen", "adapters.autogen"),
    ("agents", "adapters.openai_agents"),
    ("litellm", "adapters.litellm"),
]

# framework top-level package -> adapter module, for prepare()
_HOOKS: dict[str, str] = {
    "langchain_openai": "adapters.langchain",
    "autogen_agentchat": "adapters.autogen",
    "autogen_ext": "adapters.autogen",
    "agents": "adapters.openai_agents",
    "litellm": "adapters.litellm",
}


def resolve(obj: Any) -> list[Any] | None:
    """The HTTP clients behind a framework object, or None if no adapter knows it."""
    type_module = type(obj).__module__ if not isinstance(obj, type(importlib)) else obj.__name__
    for prefix, module_name in _ADAPTERS:
        if type_module == prefix or type_module.startswith(prefix + "."):
            adapter = importlib.import_module(module_name)
            found = adapter.http_clients(obj)
            if found is not None:
                return found
    return None


def prepare() -> None:
    """Install the identity/rebuild hooks of every adapter whose framework is imported. Never raises."""
    for package, module_name in _HOOKS.items():
        if package not in sys.modules:
            continue
        try:
            adapter = importlib.import_module(module_name)
            hook = getattr(adapter, "install_hooks", None)
            if hook is not None:
                hook()
        except Exception:  # a hook must never stop wrap(): calls still record, only without names
            import logging

            logging.getLogger(__name__).exception("could not install the %s adapter hooks", package)
