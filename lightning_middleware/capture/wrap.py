"""`wrap(client)`: the one line an agent adds.

For an `openai.OpenAI` / `AsyncOpenAI`, an `anthropic.Anthropic` / `AsyncAnthropic` (or a bare
httpx/httpx2 client) the recording transport goes straight onto the HTTP client that sends.
Anything else is handed to `adapters`, which know where each framework keeps that client.

Responses API and Anthropic Messages requests are translated into chat completions on their way
to a chat-completions server (vLLM), so they carry token IDs and train like chat calls
(`translate`, docs/formats.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from lightning_middleware.capture.calls import CaptureSettings
from lightning_middleware.capture.transport import install, installed_settings, is_http_client
from lightning_middleware.store import TraceStore, get_store

log = logging.getLogger(__name__)

T = TypeVar("T")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")


def http_clients_of(obj: Any) -> list[Any]:
    """The httpx/httpx2 clients through which `obj` sends its LLM requests."""
    if is_http_client(obj):
        return [obj]
    inner = getattr(obj, "_client", None)
    # openai.OpenAI / AsyncOpenAI and compatibles; anthropic.Anthropic / AsyncAnthropic
    if is_http_client(inner) and (hasattr(obj, "chat") or hasattr(obj, "messages")):
        return [inner]
    from adapters import resolve  # lazy: adapters import their frameworks lazily too

    found = resolve(obj)
    if found is None:
        raise TypeError(
            f"wrap() does not know how to record {type(obj).__module__}.{type(obj).__qualname__}: pass an "
            "openai OpenAI/AsyncOpenAI or anthropic Anthropic/AsyncAnthropic client, an httpx client, or a "
            "supported framework object "
            "(LangChain ChatOpenAI, AutoGen OpenAIChatCompletionClient, Agents SDK model, litellm)"
        )
    return found


def _translate_setting(value: bool | None) -> bool | None:
    if value is not None:
        return value
    env = os.environ.get("LIGHTNING_TRANSLATE", "").strip().lower()
    return None if env in ("", "auto") else env not in ("0", "false", "no", "off")


def wrap(client: T, *, store: TraceStore | str | None = None, record_unattached: bool | None = None,
         inject_token_ids: bool = True, translate: bool | None = None, policies: Mapping[str, str] | None = None,
         default_policy: str | None = None, exact_history: bool | None = None) -> T:
    """Record every LLM call `client` makes; returns the same object, instrumented in place.

    `translate`: Responses API / Anthropic Messages requests are sent as chat completions (and
    their answers translated back) so that vLLM returns token IDs for them. None (default, or
    `$LIGHTNING_TRANSLATE=auto`): on, except towards the format's own vendor API
    (api.openai.com, api.anthropic.com); True: always; False: never (for a server that really
    speaks the format; those calls are recorded without token IDs).

    `policies` maps agent names (`agent_scope`, or what the framework's adapter knows: AutoGen and
    Agents SDK agent names, LangGraph nodes) to the served model name of each agent's own policy
    (a LoRA adapter): a call of agent X is sent, and recorded, under X's policy whatever model
    the code wrote; `default_policy` takes the calls of every other agent (None: as written).

    `exact_history`: send a rollout's earlier tool-calling turns back to the engine as the text
    the model sampled, not as the framework's structured tool calls re-rendered by the chat
    template, so that each turn's prompt continues the last one token for token (for ChatML /
    hermes-style templates; `capture.exact_history`). Off by default.

    Wrapping twice is harmless (the second call only updates the settings you pass).
    The store is opened here, so a bad store URL fails now, not inside an LLM call.
    """
    targets = http_clients_of(client)
    # Adapters of frameworks already imported add their process-wide hooks (agent
    # names, rebuilt objects): also needed when a plain openai client is wrapped and
    # then handed to a framework (Agents SDK `set_default_openai_client`).
    from adapters import prepare

    prepare()
    if not targets:
        raise TypeError(f"found no HTTP client to record in {type(client).__qualname__}")
    for http_client in targets:
        previous = installed_settings(http_client)
        settings = CaptureSettings(
            store=get_store(store) if (store is not None or previous is None) else previous.store,
            record_unattached=(record_unattached if record_unattached is not None else
                               previous.record_unattached if previous is not None else
                               _env_flag("LIGHTNING_RECORD_UNATTACHED", True)),
            inject_token_ids=inject_token_ids,
            translate=_translate_setting(translate),
            policies=dict(policies) if policies is not None else previous.policies if previous is not None else {},
            default_policy=default_policy if default_policy is not None else
            previous.default_policy if previous is not None else None,
            exact_history=exact_history if exact_history is not None else
            previous.exact_history if previous is not None else False,
        )
        if previous is not None:
            settings.no_inject_hosts = previous.no_inject_hosts
            settings.eos_ids = previous.eos_ids
        install(http_client, settings)
    return client
