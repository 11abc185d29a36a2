"""LangChain (langchain-openai) adapter.

`ChatOpenAI` (any `BaseChatOpenAI`, e.g. `AzureChatOpenAI`) sends every request
through two openai SDK clients, `root_client` (sync) and `root_async_client`
(async); its `client` / `async_client` attributes are their `.chat.completions`
resources, so they share the same HTTP clients. We record on
`root_client._client` and `root_async_client._client` (httpx2 with openai 3.x).

Note: langchain-openai caches its default HTTP clients per (base_url, timeout,
socket options). Every `ChatOpenAI` built with the same settings shares them, so
wrapping one records them all (into the store of the latest `wrap()`), including
ones built later (`model_copy()`, re-created models): recording never silently
stops. Pass `http_client=` / `http_async_client=` to keep a model separate.

Agent names: wrap() adds a callback handler to the model that names each call
from the run's metadata `lightning_agent`, `lc_agent_name` (set by
`langchain.agents.create_agent(name=...)`), a tag `agent:<name>`, a run name set
by the user (`.with_config(run_name=...)`), or else the LangGraph node the call
runs in (metadata `langgraph_node`), in that order: a graph's nodes are its agents.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

_HANDLER: Any = None


def _chat_model(obj: Any) -> Any:
    """The BaseChatOpenAI inside `obj` (the model, a RunnableBinding of it, or a sequence starting with it)."""
    from langchain_openai.chat_models.base import BaseChatOpenAI

    seen = 0
    while obj is not None and seen < 16:
        seen += 1
        if isinstance(obj, BaseChatOpenAI):
            return obj
        if hasattr(obj, "bound"):  # RunnableBinding (bind_tools, with_config, ...)
            obj = obj.bound
        elif hasattr(obj, "first") and hasattr(obj, "steps"):  # RunnableSequence
            obj = next((s for s in obj.steps if _chat_model_or_none(s) is not None), None)
        else:
            return None
    return None


def _chat_model_or_none(obj: Any) -> Any:
    try:
        return _chat_model(obj)
    except Exception:
        return None


def http_clients(obj: Any) -> list[Any] | None:
    model = _chat_model(obj)
    if model is None:
        return None
    clients = [c._client for c in (model.root_client, model.root_async_client) if c is not None]
    if not clients:
        raise TypeError("this ChatOpenAI has no openai client yet (no API key?); build it with api_key=...")
    _add_name_handler(model)
    return clients


def _handler_class() -> type:
    from langchain_core.callbacks import BaseCallbackHandler

    from lightning_middleware.capture import current_agent, set_current_agent

    class AgentNameHandler(BaseCallbackHandler):
        """Sets the agent-name ContextVar around each chat model run (inline: same context as the HTTP call)."""

        run_inline = True
        raise_error = False

        def __init__(self) -> None:
            self._previous: dict[UUID, Any] = {}

        @staticmethod
        def _name(metadata: dict[str, Any] | None, tags: list[str] | None, name: str | None,
                   serialized: dict[str, Any] | None) -> str | None:
            md = metadata or {}
            for key in ("lightning_agent", "lc_agent_name"):
                if md.get(key):
                    return str(md[key])
            for tag in tags or []:
                if isinstance(tag, str) and tag.startswith("agent:"):
                    return tag[len("agent:"):]
            default = (serialized or {}).get("name") or (serialized or {}).get("id", [None])[-1]
            if name and name != default and not name.endswith("ChatOpenAI"):
                return name
            node = md.get("langgraph_node")
            return str(node) if node else None

        def on_chat_model_start(self, serialized: dict[str, Any], messages: Any, *, run_id: UUID,
                                parent_run_id: UUID | None = None, tags: list[str] | None = None,
                                metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
            name = self._name(metadata, tags, kwargs.get("name"), serialized)
            if name is not None:
                self._previous[run_id] = current_agent()
                set_current_agent(name)

        def _restore(self, run_id: UUID) -> None:
            if run_id in self._previous:
                # set() rather than reset(token): the end event may run in another context (streams)
                set_current_agent(self._previous.pop(run_id))

        def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
            self._restore(run_id)

        def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
            self._restore(run_id)

    return AgentNameHandler


def _add_name_handler(model: Any) -> None:
    global _HANDLER
    if _HANDLER is None:
        _HANDLER = _handler_class()()
    from langchain_core.callbacks import BaseCallbackManager

    callbacks = model.callbacks
    if callbacks is None:
        model.callbacks = [_HANDLER]
    elif isinstance(callbacks, list):
        if not any(h is _HANDLER for h in callbacks):
            model.callbacks = [*callbacks, _HANDLER]
    elif isinstance(callbacks, BaseCallbackManager):
        if _HANDLER not in callbacks.handlers:
            callbacks.add_handler(_HANDLER, inherit=False)
