"""`previous_response_id`: the conversation a translated Responses answer continues, read back
from the trace store (the answer's id is `resp_<the id of the call recorded for it>`)."""

from __future__ import annotations

import time
from typing import Any

from lightning_middleware.formats.common import History, TranslationError, first_message
from lightning_middleware.records import LLMCall
from lightning_middleware.store import TraceStore

RESPONSE_PREFIX = "resp_"
# A streamed answer is recorded just after its last byte is sent: a caller that continues it at
# once may ask before the record is even submitted. A missing id is looked for this long.
WAIT_FOR_RECORD_S = 1.0


def store_history(store: TraceStore) -> History:
    """A `History` that looks each previous response up in `store`."""

    def history(response_id: str) -> list[dict[str, Any]]:
        try:
            call = _call_for(store, response_id)
        except Exception as exc:  # noqa: BLE001 - the store is down: the caller learns why, and may retry
            raise TranslationError("previous_response_id", f"the trace store could not be read ({exc})",
                                   status=503, code="store_unavailable") from None
        return conversation_of(call, response_id)

    return history


def _call_for(store: TraceStore, response_id: str) -> LLMCall | None:
    if not response_id.startswith(RESPONSE_PREFIX):
        return None
    call_id = response_id[len(RESPONSE_PREFIX):]
    call = store.get_call(call_id)
    deadline = time.monotonic() + WAIT_FOR_RECORD_S
    while call is None and time.monotonic() < deadline:
        store.flush()  # answered a moment ago: its record may still be on the store's writer thread
        call = store.get_call(call_id)
        if call is None:
            time.sleep(0.05)
    return call


def conversation_of(call: LLMCall | None, response_id: str) -> list[dict[str, Any]]:
    """The chat messages of the conversation up to and including `call`'s answer.

    The previous call's own instructions are not part of it (the Responses API carries
    `instructions` over to no later response); its answer is the assistant message the engine
    wrote, text and tool calls together, as the next prompt must render it.
    """
    if call is None or call.source_format != "responses":
        raise TranslationError("previous_response_id", f"no response {response_id!r} in the trace store",
                               code="previous_response_not_found")
    if call.status_code is None or not 200 <= call.status_code < 300 or call.partial or not call.response:
        raise TranslationError("previous_response_id", f"response {response_id!r} did not complete",
                               code="previous_response_not_found")
    messages = list(call.request.get("messages") or [])
    if (call.source_request or {}).get("instructions") is not None and messages:
        messages = messages[1:]
    _, message = first_message(call.response)
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        reply["tool_calls"] = [{"id": tc.get("id"), "type": "function", "function": tc.get("function")}
                               for tc in message["tool_calls"]]
    return [*messages, reply]
