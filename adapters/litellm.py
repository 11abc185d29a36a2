"""LiteLLM (>= 1.110) adapter: `wrap(litellm)` or `wrap(router)`.

LiteLLM has no single client object: it creates HTTP clients on demand and
caches them (`litellm.in_memory_llm_clients_cache`, with a TTL, per provider and
parameters), and builds openai SDK clients for the `openai/` provider. The
`hosted_vllm/` provider (the one to use with vLLM) bypasses the openai SDK and
posts through LiteLLM's own `HTTPHandler` / `AsyncHTTPHandler` (httpx).

Wrapping only the clients that exist now would silently stop recording when the
cache expires or a new provider/parameter set needs a new client, so wrap()
does both:

1. records on every client that exists: cached `HTTPHandler`/`AsyncHTTPHandler`
   clients, cached openai SDK clients, `litellm.client_session` /
   `aclient_session`, and `litellm.module_level_client` / `module_level_aclient`;
2. hooks the factories every later client comes from, `HTTPHandler.create_client`,
   `AsyncHTTPHandler.create_client` (including their re-creation of closed
   clients) and `BaseOpenAILLM._get_sync_http_client` / `_get_async_http_client`
   (the HTTP clients of new openai SDK clients), so they record too.

Setting `litellm.client_session`/`aclient_session` alone would not do: the
`hosted_vllm/` path never reads them. The settings of the latest wrap() are
held by a private anchor client that sends nothing; the hook copies them.
A `Router` sends through the same module-level machinery, so `wrap(router)` is
`wrap(litellm)` (process-wide). LiteLLM exposes no agent name: use
`lightning_middleware.agent_scope(name)`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)
_anchor: Any = None
_hooks_installed = False


def http_clients(obj: Any) -> list[Any] | None:
    import litellm

    if not (obj is litellm or isinstance(obj, litellm.Router)):
        return None
    install_hooks()
    return _existing_clients(litellm)


def _anchor_client() -> Any:
    global _anchor
    if _anchor is None:
        import httpx

        _anchor = httpx.Client()  # holds the latest wrap() settings; never sends anything
    return _anchor


def _existing_clients(litellm: Any) -> list[Any]:
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler, HTTPHandler

    from lightning_middleware.capture import is_http_client

    found: list[Any] = [_anchor_client()]
    candidates: list[Any] = [litellm.client_session, litellm.aclient_session,
                              vars(litellm).get("module_level_client"), vars(litellm).get("module_level_aclient")]
    cache = getattr(litellm, "in_memory_llm_clients_cache", None)
    candidates += list(getattr(cache, "cache_dict", {}).values())
    for item in candidates:
        if isinstance(item, (HTTPHandler, AsyncHTTPHandler)):
            item = item._client
        elif not is_http_client(item) and is_http_client(getattr(item, "_client", None)):
            item = item._client  # an openai SDK client
        if is_http_client(item) and all(item is not f for f in found):
            found.append(item)
    return found


def _record_new(client: Any) -> Any:
    """Install the latest wrap() settings on a client LiteLLM just created. Never raises."""
    try:
        from lightning_middleware.capture import CaptureSettings, install, installed_settings, is_http_client

        settings = installed_settings(_anchor_client())
        if settings is not None and is_http_client(client):
            fresh = CaptureSettings(store=settings.store, record_unattached=settings.record_unattached,
                                    inject_token_ids=settings.inject_token_ids,
                                    inject_logprobs=settings.inject_logprobs)
            fresh.no_inject_hosts = settings.no_inject_hosts
            install(client, fresh)
    except Exception:
        log.exception("could not record a client LiteLLM created")
    return client


def install_hooks() -> None:
    """Idempotent: every HTTP client LiteLLM creates from now on records (once wrap() was called)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler, HTTPHandler
    from litellm.llms.openai.common_utils import BaseOpenAILLM

    for cls in (HTTPHandler, AsyncHTTPHandler):
        original = cls.create_client

        @functools.wraps(original)
        def create_client(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            return _record_new(__original(self, *args, **kwargs))

        setattr(cls, "create_client", create_client)  # noqa: B010 - a method replaced on the class
    for name in ("_get_sync_http_client", "_get_async_http_client"):
        original = getattr(BaseOpenAILLM, name)  # a staticmethod, resolved to its function

        @functools.wraps(original)
        def factory(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            return _record_new(__original(*args, **kwargs))

        setattr(BaseOpenAILLM, name, staticmethod(factory))
