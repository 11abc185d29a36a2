"""Requests with n > 1 through wrap(): every choice recorded with its own token IDs and logprobs,
stream and not, chat and completions; the caller gets exactly what the server sent."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.capture.assembly import StreamAssembler, parse_body
from lightning_middleware.records import Choice, LLMCall
from lightning_middleware.rows import build_rows
from lightning_middleware.testing import TEST_BASE_URL, llm_http_client, render_chat, tokenize
from lightning_middleware.testing.llm_script import reply

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "math",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
ANSWERS = ["echo: what is 2+2?", "echo 1: what is 2+2?", "echo 2: what is 2+2?"]


def _client(store: TraceStore) -> openai.OpenAI:
    return wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="sk-test", http_client=llm_http_client(httpx2)),
                store=store)


def _server_logprobs(k: int, n: int) -> list[float]:
    """What the test server sends as choice k's logprobs (llm_script: -((i + k) % 7) / 10)."""
    return [-((i + k) % 7) / 10 for i in range(n)]


def _assert_every_choice(call: LLMCall, answers: list[str], prompt: list[int]) -> None:
    """The record holds each choice's own token IDs and logprobs, as the server sent them."""
    assert call.prompt_token_ids == tuple(prompt) and call.is_training and not call.partial
    assert [c.index for c in call.choices] == list(range(len(answers)))
    for k, (choice, text) in enumerate(zip(call.choices, answers)):
        assert choice.completion_token_ids == tuple(tokenize(text)), k
        assert choice.logprobs == pytest.approx(_server_logprobs(k, len(tokenize(text))), abs=1e-6), k
        assert choice.finish_reason == "stop"
    assert call.completion_token_ids == call.choices[0].completion_token_ids  # choice 0: the columns, as before


def _without_volatile(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_chat_n3_records_every_choice_and_the_caller_gets_the_servers_answer(store: TraceStore) -> None:
    client = _client(store)
    with rollout("n3", store=store) as r:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MSGS, n=3)
    out = raw.parse()
    assert [c.message.content for c in out.choices] == ANSWERS
    # What the server answers to the request the caller wrote (id and created aside: they vary).
    direct = reply("/v1/chat/completions", {}, json.dumps({"model": "m", "messages": MSGS, "n": 3}).encode())
    assert _without_volatile(json.loads(raw.http_response.content)) == _without_volatile(direct.body)
    [call] = store.calls(r.id)
    _assert_every_choice(call, ANSWERS, tokenize(render_chat(MSGS)))
    assert [c["message"]["content"] for c in call.response["choices"]] == ANSWERS
    assert all("token_ids" not in c for c in call.response["choices"])  # arrays are stored apart
    assert "lightning_extra_choices" not in call.response


def test_chat_n3_stream_assembles_each_choice_by_index(store: TraceStore) -> None:
    client = _client(store)
    with rollout("n3s", store=store) as r:
        plain = client.chat.completions.create(model="m", messages=MSGS, n=3)
        stream = client.chat.completions.create(model="m", messages=MSGS, n=3, stream=True,
                                                stream_options={"include_usage": True})
        texts: dict[int, str] = {}
        order = []
        for chunk in stream:
            for ch in chunk.choices:
                order.append(ch.index)
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                assert not hasattr(ch, "token_ids") or ch.token_ids is None  # stripped, as asked
    assert [texts[k] for k in range(3)] == ANSWERS and order[:3] == [0, 1, 2]  # the choices interleave
    nonstream, streamed = store.calls(r.id)
    assert streamed.stream and not nonstream.stream
    _assert_every_choice(streamed, ANSWERS, tokenize(render_chat(MSGS)))
    assert streamed.choices == nonstream.choices and streamed.extra_choices == nonstream.extra_choices
    assert [c["message"]["content"] for c in streamed.response["choices"]] == ANSWERS
    assert streamed.response["usage"]["completion_tokens"] == sum(len(tokenize(a)) for a in ANSWERS)
    assert [c.message.content for c in plain.choices] == ANSWERS


@pytest.mark.parametrize("stream", [False, True])
def test_completions_n3(store: TraceStore, stream: bool) -> None:
    client = _client(store)
    answers = ["echo: hello", "echo 1: hello", "echo 2: hello"]
    with rollout("cmpl", store=store) as r:
        out = client.completions.create(model="m", prompt="hello", n=3, stream=stream)
        if stream:
            texts: dict[int, str] = {}
            for chunk in out:
                for ch in chunk.choices:
                    texts[ch.index] = texts.get(ch.index, "") + ch.text
            got = [texts[k] for k in range(3)]
        else:
            got = [c.text for c in out.choices]
    assert got == answers
    [call] = store.calls(r.id)
    assert call.endpoint == "completions" and call.stream == stream
    _assert_every_choice(call, answers, tokenize("hello"))


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_of_every_choice(store: TraceStore, stream: bool) -> None:
    client = _client(store)
    with rollout("tools", store=store) as r:
        out = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, n=2, stream=stream)
        if stream:
            list(out)
    [call] = store.calls(r.id)
    args = [json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) for c in call.response["choices"]]
    assert args == [{"query": "what is 2+2?"}, {"query": "what is 2+2?", "variant": 1}]
    assert len(call.choices) == 2
    for k, choice in enumerate(call.choices):
        text = '<tool_call>{"name": "calc", "arguments": ' + json.dumps(args[k]) + "}</tool_call>"
        assert choice.completion_token_ids == tuple(tokenize(text)) and choice.finish_reason == "tool_calls"


def test_stream_closed_before_every_choice_ended_is_partial(store: TraceStore) -> None:
    client = _client(store)
    with rollout("early", store=store) as r:
        stream = client.chat.completions.create(model="m", messages=MSGS, n=3, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].index == 0 and chunk.choices[0].finish_reason:
                break  # choice 0 has ended; choices 1 and 2 have not
        stream.close()
    [call] = store.calls(r.id)
    assert call.partial and not call.is_training
    assert call.completion_token_ids == tuple(tokenize(ANSWERS[0]))


def test_the_trainer_trains_the_choice_the_agent_continued(store: TraceStore) -> None:
    """An agent samples 3 answers, keeps choice 1 and goes on: the row holds choice 1's tokens with
    the logprobs the server sent for them, choice 0 and 2 are not in it."""
    client = _client(store)
    with rollout("pick", store=store) as r:
        first = client.chat.completions.create(model="m", messages=MSGS, n=3)
        kept = first.choices[1].message
        msgs = MSGS + [{"role": "assistant", "content": kept.content}, {"role": "user", "content": "sure?"}]
        client.chat.completions.create(model="m", messages=msgs)
    calls = store.calls(r.id)
    [row], stats = build_rows(calls, rollout_id=r.id)
    assert row.choices == (1, 0) and stats.other_choices == 1 and stats.merges == 1
    prompt = tokenize(render_chat(MSGS))
    chosen = tokenize(ANSWERS[1])
    assert row.input_ids[:len(prompt) + len(chosen)] == tuple(prompt + chosen)
    assert row.loss_mask[len(prompt):len(prompt) + len(chosen)] == (1,) * len(chosen)
    lps = row.behaviour_logprobs
    assert lps is not None
    assert lps[len(prompt):len(prompt) + len(chosen)] == pytest.approx(_server_logprobs(1, len(chosen)), abs=1e-6)


def test_without_token_ids_no_choice_is_kept(store: TraceStore) -> None:
    client = _client(store)
    with rollout("no-ids", store=store) as r:
        out = client.chat.completions.create(model="m", messages=MSGS, n=3, extra_body={"return_token_ids": False})
    assert [c.message.content for c in out.choices] == ANSWERS
    [call] = store.calls(r.id)
    assert call.extra_choices == () and not call.is_training
    assert [c["message"]["content"] for c in call.response["choices"]] == ANSWERS  # the texts are still there


def _completion_choice(index: int, prompt: list[int], ids: list[int]) -> dict:
    return {"index": index, "text": "x", "finish_reason": "stop", "prompt_token_ids": prompt, "token_ids": ids,
            "logprobs": {"token_logprobs": [-0.5] * len(ids)}}


def test_a_batch_of_prompts_is_not_a_set_of_choices() -> None:
    """completions with a list of prompts answers a choice per prompt: only the choices of choice 0's
    prompt are alternatives to it."""
    body = {"choices": [_completion_choice(0, [1, 2], [3]), _completion_choice(1, [1, 2], [4, 5]),
                        _completion_choice(2, [9], [6]), _completion_choice(3, [9], [7])]}
    got = parse_body(json.dumps(body).encode(), "completions")
    assert got.prompt_token_ids == [1, 2] and got.completion_token_ids == [3]
    assert got.extra_choices == [Choice(1, (4, 5), (-0.5, -0.5), "stop")]
    stream = StreamAssembler("completions")
    for ch in reversed(body["choices"]):  # any order: assembled by index
        stream.feed(f"data: {json.dumps({'choices': [ch]})}\n\n".encode())
    result = stream.result()
    assert result.complete and result.completion_token_ids == [3]
    assert result.extra_choices == [Choice(1, (4, 5), (-0.5, -0.5), "stop")]
    assert [c["index"] for c in result.response["choices"]] == [0, 1, 2, 3]


def test_broken_choices_cost_only_themselves() -> None:
    body = {"prompt_token_ids": [1], "choices": [
        {"index": 0, "message": {"content": "a"}, "token_ids": [2], "finish_reason": "stop"},
        {"index": 1, "message": {"content": "b"}, "token_ids": ["x"], "finish_reason": "stop"},
        {"index": 2, "message": {"content": "c"}, "token_ids": [3], "logprobs": {"content": [{"no": 1}]}},
        {"index": 2, "message": {"content": "d"}, "token_ids": [4]}]}
    got = parse_body(json.dumps(body).encode(), "chat.completions")
    assert got.completion_token_ids == [2] and got.extra_choices == [Choice(2, (3,), None, None)]
