"""Caller formats other than chat completions, translated so that vLLM answers them with token IDs.

A harness that speaks the OpenAI Responses API or Anthropic Messages sends its request as it
is; `wrap()`'s transport and the gateway translate it into a chat-completions request (one
module per format: `responses`, `anthropic`), record that call like any other (the prompt and
completion token IDs are those of the translated request, so rows merge and train unchanged;
`LLMCall.source_request` keeps what the caller sent) and translate the engine's answer back,
stream or whole, into the caller's format. What chat completions cannot express is refused
with a 4xx naming the field (`TranslationError`), never dropped. docs/formats.md has the tables.
"""

from __future__ import annotations

from lightning_middleware.formats import anthropic, responses
from lightning_middleware.formats.common import Buffered, ChatStream, Format, History, TranslationError
from lightning_middleware.formats.history import store_history

FORMATS: dict[str, Format] = {f.route: f for f in (responses.FORMAT, anthropic.FORMAT)}


def format_for_path(path: str) -> Format | None:
    """The format a request path posts in (`.../responses`, `.../v1/messages`), or None."""
    path = path.rstrip("/")
    for fmt in FORMATS.values():
        if path.endswith(fmt.suffix):
            return fmt
    return None


def chat_path(path: str, fmt: Format) -> str:
    """The chat-completions path beside a format's path (same base URL)."""
    return path.rstrip("/")[: -len(fmt.route)] + "chat/completions"


__all__ = ["FORMATS", "Buffered", "ChatStream", "Format", "History", "TranslationError", "chat_path",
           "format_for_path", "store_history"]
