"""OpenAI Agents SDK (openai-agents >= 0.24) adapter.

The SDK sends through an `AsyncOpenAI`: the one given to
`set_default_openai_client(...)` (wrap it like any openai client), the one in an
`OpenAIChatCompletionsModel(openai_client=...)` / `OpenAIResponsesModel`, or the
one an `OpenAIProvider` builds. wrap() of such a model, provider, or of an
`Agent` whose `model` is such an object, records on `model._client._client`.

Chat completions carry vLLM's token IDs; the Responses API (the SDK's default) is
translated into chat completions by the recording transport (docs/formats.md), so
those calls are training calls too (`wrap(..., translate=False)`: sent as they are,
recorded without token IDs).

Agent names: the SDK's run loop calls `get_new_response(bindings, ...)` (non-
streamed) and `run_single_turn_streamed(streamed_result, bindings, ...)` once per
model turn, with the agent in `bindings.public_agent`. The hook wraps both (in
`agents.run_internal.run_loop`, where they are looked up) so the turn runs in
`agent_scope(agent.name)`; handoffs therefore show each agent's name. If a future
SDK renames them, calls are still recorded, without names, and a warning says so.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)
_hooks_installed = False


def http_clients(obj: Any) -> list[Any] | None:
    from agents import Agent
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    install_hooks()
    if isinstance(obj, (OpenAIChatCompletionsModel, OpenAIResponsesModel)):
        return [obj._client._client]
    if isinstance(obj, OpenAIProvider):
        return [obj._get_client()._client]
    if isinstance(obj, Agent):
        if isinstance(obj.model, (OpenAIChatCompletionsModel, OpenAIResponsesModel)):
            return [obj.model._client._client]
        raise TypeError(
            f"agent {obj.name!r} names its model as {obj.model!r}, so the SDK picks the client at run time: wrap "
            "the AsyncOpenAI you pass to agents.set_default_openai_client(), or give the agent an "
            "OpenAIChatCompletionsModel(model=..., openai_client=wrap(AsyncOpenAI(...)))")
    return None


def _named_turn(fn: Any, bindings_index: int) -> Any:
    if getattr(fn, "_lightning_named", False):
        return fn

    @functools.wraps(fn)
    async def turn(*args: Any, **kwargs: Any) -> Any:
        from lightning_middleware.capture import agent_scope

        bindings = kwargs.get("bindings", args[bindings_index] if len(args) > bindings_index else None)
        agent = getattr(bindings, "public_agent", None)
        name = getattr(agent, "name", None)
        if not isinstance(name, str):
            return await fn(*args, **kwargs)
        with agent_scope(name):
            return await fn(*args, **kwargs)

    turn._lightning_named = True  # type: ignore[attr-defined]
    return turn


def install_hooks() -> None:
    """Idempotent: name each model turn after the agent taking it."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    try:
        from agents.run_internal import run_loop
    except ImportError:
        log.warning("openai-agents changed: no agents.run_internal.run_loop; calls are recorded without agent "
                    "names (use lightning_middleware.agent_scope)")
        return
    for name, index in (("get_new_response", 0), ("run_single_turn_streamed", 1)):
        fn = getattr(run_loop, name, None)
        if fn is None:
            log.warning("openai-agents changed: run_loop.%s is gone; calls are recorded without agent names", name)
            continue
        setattr(run_loop, name, _named_turn(fn, index))
