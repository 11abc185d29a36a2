"""The benchmark agents' chat model: LangChain's `ChatOpenAI`, `wrap()`ed, one per event loop.

langchain-openai caches a default async HTTP client per base URL, which the next controller run (a
new event loop) would find bound to a closed one ("Event loop is closed"); each loop gets its own.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any


def chat_per_loop(base_url: str, *, model: str, store: Any = None, api_key: str = "-", timeout_s: float = 600.0,
                  **options: Any) -> Callable[[], Any]:
    """A function that returns the running event loop's wrapped `ChatOpenAI` (made on first use);
    `options` are ChatOpenAI's own (temperature, max_tokens, ...)."""
    import httpx
    from langchain_openai import ChatOpenAI

    from lightning_middleware import wrap

    chats: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

    def chat() -> Any:
        loop = asyncio.get_running_loop()
        if loop not in chats:
            llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=2,
                             http_async_client=httpx.AsyncClient(timeout=timeout_s), **options)
            chats[loop] = wrap(llm, store=store)  # the one line
        return chats[loop]

    return chat
