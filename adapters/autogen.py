"""AutoGen (autogen-ext / autogen-agentchat 0.7) adapter.

`OpenAIChatCompletionClient` (and the Azure variant) keeps an `AsyncOpenAI` in
`_client`; every `create` / `create_stream` goes through its HTTP client
(`_client._client`, httpx2 with openai 3.x). wrap() records there. wrap() of an
agent that has a `_model_client` (e.g. `AssistantAgent`) wraps that client.

Agent names: AgentChat opens `autogen_core.trace_invoke_agent_span(agent_name)`
around every agent invocation (`agent.run`/`run_stream` and inside teams). The
hook wraps that context manager, in the two modules that call it, so it also
sets `agent_scope(agent_name)`; calls made inside carry the agent's name.

Rebuilt clients: a recording client that is copied or pickled (`__getstate__`/
`__setstate__` rebuild the AsyncOpenAI) or dumped and loaded
(`dump_component`/`load_component`) keeps recording: the hook marks its state or
config, and the rebuilt client is wrapped again with the same settings. A
config dumped in another process can't carry the store: loading it raises and
says to call wrap() on the loaded client.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

MARK_HEADER = "x-lightning-capture"  # in dumped configs only; removed again on load
_STATE_KEY = "_lightning_capture"
_tokens: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # token -> CaptureSettings
_hooks_installed = False


def http_clients(obj: Any) -> list[Any] | None:
    from autogen_ext.models.openai._openai_client import BaseOpenAIChatCompletionClient

    install_hooks()
    if isinstance(obj, BaseOpenAIChatCompletionClient):
        return [obj._client._client]
    inner = getattr(obj, "_model_client", None)
    if inner is not None:  # AssistantAgent and friends
        if not isinstance(inner, BaseOpenAIChatCompletionClient):
            raise TypeError(f"this agent's model client is a {type(inner).__qualname__}; only the OpenAI "
                            "chat completion clients of autogen-ext can be recorded")
        return [inner._client._client]
    return None


def _settings_of(client: Any) -> Any:
    from lightning_middleware.capture import installed_settings

    try:
        return installed_settings(client._client._client)
    except AttributeError:
        return None


def _token_for(settings: Any) -> str:
    for token, known in list(_tokens.items()):
        if known is settings:
            return token
    token = uuid.uuid4().hex
    _tokens[token] = settings
    return token


def _rewrap(client: Any, settings: Any) -> None:
    from lightning_middleware.capture import CaptureSettings, install

    fresh = CaptureSettings(store=settings.store, record_unattached=settings.record_unattached,
                            inject_token_ids=settings.inject_token_ids, inject_logprobs=settings.inject_logprobs)
    fresh.no_inject_hosts = settings.no_inject_hosts
    install(client._client._client, fresh)


def _patch_client_class(cls: Any) -> None:
    if getattr(cls, "_lightning_patched", False) or "__setstate__" not in vars(cls):
        return
    orig_getstate, orig_setstate = cls.__getstate__, cls.__setstate__
    orig_to_config, orig_from_config = cls._to_config, cls._from_config.__func__

    def __getstate__(self: Any) -> dict[str, Any]:
        state = orig_getstate(self)
        settings = _settings_of(self)
        if settings is not None:
            state[_STATE_KEY] = {"token": _token_for(settings),
                                 "store_url": settings.store.url.render_as_string(hide_password=False),
                                 "record_unattached": settings.record_unattached}
        return state

    def __setstate__(self: Any, state: dict[str, Any]) -> None:
        mark = state.pop(_STATE_KEY, None)
        orig_setstate(self, state)
        if mark is None:
            return
        settings = _tokens.get(mark["token"])
        if settings is not None:
            _rewrap(self, settings)
        else:  # unpickled in another process: reopen the same store by URL
            from lightning_middleware.capture import wrap

            wrap(self, store=mark["store_url"], record_unattached=mark["record_unattached"])

    def _to_config(self: Any) -> Any:
        config = orig_to_config(self)
        settings = _settings_of(self)
        if settings is not None:
            headers = dict(config.default_headers or {})
            headers[MARK_HEADER] = _token_for(settings)
            config = config.model_copy(update={"default_headers": headers})
        return config

    def _from_config(klass: Any, config: Any) -> Any:
        headers = dict(getattr(config, "default_headers", None) or {})
        token = headers.pop(MARK_HEADER, None)
        if token is None:
            return orig_from_config(klass, config)
        settings = _tokens.get(token)
        if settings is None:
            raise RuntimeError(
                "this model client config was dumped from a client that lightning-middleware recorded in "
                f"another process; remove the '{MARK_HEADER}' default header from the config, load it, and "
                "call lightning_middleware.capture.wrap(client, store=...) on the loaded client to keep recording")
        client = orig_from_config(klass, config.model_copy(update={"default_headers": headers or None}))
        _rewrap(client, settings)
        return client

    cls.__getstate__, cls.__setstate__, cls._to_config = __getstate__, __setstate__, _to_config
    cls._from_config = classmethod(_from_config)
    cls._lightning_patched = True


def _named(original: Any) -> Any:
    if getattr(original, "_lightning_named", False):
        return original

    @functools.wraps(original)
    @contextlib.contextmanager
    def trace_invoke_agent_span(agent_name: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        from lightning_middleware.capture import agent_scope

        with original(agent_name, *args, **kwargs) as span, agent_scope(agent_name):
            yield span

    trace_invoke_agent_span._lightning_named = True  # type: ignore[attr-defined]
    return trace_invoke_agent_span


def install_hooks() -> None:
    """Idempotent: agent names from AgentChat's invoke-agent span; rebuilt clients keep recording."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    try:
        from autogen_ext.models.openai import _openai_client

        _patch_client_class(_openai_client.OpenAIChatCompletionClient)
        _patch_client_class(_openai_client.AzureOpenAIChatCompletionClient)
    except ImportError:
        pass
    try:
        from autogen_agentchat.agents import _base_chat_agent
        from autogen_agentchat.teams._group_chat import _chat_agent_container
    except ImportError:
        return
    for module in (_base_chat_agent, _chat_agent_container):
        if hasattr(module, "trace_invoke_agent_span"):
            setattr(module, "trace_invoke_agent_span", _named(module.trace_invoke_agent_span))  # noqa: B010
        else:
            log.warning("autogen-agentchat changed: %s has no trace_invoke_agent_span; calls are recorded "
                        "without agent names (use lightning_middleware.agent_scope)", module.__name__)
