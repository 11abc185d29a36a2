"""The in-process test LLM answers exactly as the test LLM server does, and records the same."""

from __future__ import annotations

import httpx
import httpx2
import openai
import pytest

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.testing import TEST_BASE_URL, LLMTestServer, llm_http_client

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "math",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _calls(client: openai.OpenAI, store: TraceStore) -> list[tuple]:
    msgs = [{"role": "user", "content": "what is 2+2?"}]
    with rollout("same", store=store) as r:
        first = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "4"}]
        stream = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True, max_tokens=9)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        client.completions.create(model="m", prompt="hello", max_tokens=5)
    store.flush()
    return [(text,)] + [(c.endpoint, c.stream, c.finish_reason, c.prompt_token_ids, c.completion_token_ids,
                         c.logprobs, c.is_training) for c in store.calls(r.id)]


def test_in_process_answers_equal_the_server(llm_server: LLMTestServer, tmp_path) -> None:
    over_socket = TraceStore(f"sqlite:///{tmp_path / 'socket.db'}")
    in_process = TraceStore(f"sqlite:///{tmp_path / 'inproc.db'}")
    try:
        a = _calls(wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=over_socket), over_socket)
        b = _calls(wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="x", http_client=llm_http_client(httpx2)),
                        store=in_process), in_process)
    finally:
        over_socket.close()
        in_process.close()
    assert a == b and len(a) == 4 and all(call[-1] for call in a[1:])  # three training calls, equal


@pytest.mark.parametrize("module", [httpx, httpx2])
async def test_async_clients_and_404s(module) -> None:
    async with llm_http_client(module, asynchronous=True) as c:
        r = await c.post(TEST_BASE_URL + "/chat/completions", json={"model": "m", "stream": True,
                                                                     "messages": [{"role": "user", "content": "x"}]})
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        assert (await c.get(TEST_BASE_URL + "/nope")).status_code == 404
