"""`wrap(..., exact_history=True)`: a rollout's earlier tool-calling turns go back to the engine as
the text the model sampled, so the next prompt continues the last one token for token
(capture/exact_history.py). The drift it fixes is planted by the test LLM's `loose-format` model: it
samples "\\n</tool_call>", and the rendering of the structured call back leaves the "\\n" out, as
the guess demo's policy drifted the other way (docs/demo.md)."""

from __future__ import annotations

import json

import httpx
import httpx2
import openai
import pytest

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.capture.assembly import BodyCollector, EosHints, token_limit
from lightning_middleware.capture.exact_history import SampledTurns
from lightning_middleware.gateway import Gateway
from lightning_middleware.rows import build_rows
from lightning_middleware.testing import TEST_BASE_URL, LLMTestServer, llm_http_client, render_chat, tokenize

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "math",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
LOOSE = "policy-loose-format"


def _client(store: TraceStore, exact: bool) -> openai.OpenAI:
    return wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key="sk-test", http_client=llm_http_client(httpx2)),
                store=store, exact_history=exact)


def _tool_loop(client: openai.OpenAI, store: TraceStore, *, stream: bool = False, model: str = LOOSE,
               mode: str = "train") -> str:
    """Two turns as an agent writes them: the call comes back as a structured tool call."""
    messages: list[dict] = [{"role": "user", "content": "what is 6*7?"}]
    with rollout("t", store=store, mode=mode) as r:
        for _ in range(2):
            if stream:
                text, calls = "", {}
                for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True):
                    delta = chunk.choices[0].delta if chunk.choices else None
                    text += (delta.content or "") if delta else ""
                    for tc in (delta.tool_calls or []) if delta else []:
                        slot = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
                        slot["id"] = tc.id or slot["id"]
                        slot["function"]["name"] += tc.function.name or ""
                        slot["function"]["arguments"] += tc.function.arguments or ""
                message = {"role": "assistant", "content": text or None, "tool_calls": list(calls.values()) or None}
            else:
                message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS) \
                    .choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
        r.reward(1.0)
    store.flush()
    return r.id


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_sampled_turn_goes_back_as_sampled_and_the_rollout_is_one_row(store: TraceStore, stream: bool) -> None:
    drifted = _tool_loop(_client(store, exact=False), store, stream=stream)
    exact = _tool_loop(_client(store, exact=True), store, stream=stream)
    # Without it: the second prompt renders the call canonically, so it does not continue the first.
    first, second = store.calls(drifted)
    assert first.response["choices"][0]["message"]["tool_calls"]
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.completion_token_ids)] \
        != first.prompt_token_ids + first.completion_token_ids
    rows, stats = build_rows(store.calls(drifted), rollout_id=drifted)
    assert (len(rows), stats.prefix_breaks, stats.merges) == (2, 1, 0)
    # With it: the engine saw the turn as sampled; one row, every sampled token trained as sampled.
    first, second = store.calls(exact)
    sampled = bytes(first.completion_token_ids).decode()
    assert sampled.endswith('}}\n</tool_call>')
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.completion_token_ids)] \
        == first.prompt_token_ids + first.completion_token_ids
    assert second.request["messages"][1] == {"role": "assistant", "content": sampled}  # recorded as sent
    assert second.request["messages"][2]["role"] == "tool"
    rows, stats = build_rows(store.calls(exact), rollout_id=exact)
    assert (len(rows), stats.prefix_breaks, stats.merges) == (1, 0, 1)
    assert all(c.is_training for c in store.calls(exact))


def test_an_evaluation_rollout_sees_its_own_history_too(store: TraceStore) -> None:
    """Logprobs are asked for in every mode when exact_history is on (they carry the sampled text),
    and the caller still gets none it did not ask for."""
    client = _client(store, exact=True)
    rid = _tool_loop(client, store, mode="val")
    first, second = store.calls(rid)
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.completion_token_ids)] \
        == first.prompt_token_ids + first.completion_token_ids
    with rollout("t", store=store, mode="val"):
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    assert out.choices[0].logprobs is None
    plain = _tool_loop(_client(store, exact=False), store, mode="val")  # without it: as before, no logprobs
    assert all(c.logprobs is None for c in store.calls(plain))


def test_a_canonical_turn_renders_the_same_either_way(store: TraceStore) -> None:
    """Where the model sampled the template's own form, the restored turn is the same tokens."""
    plain = _tool_loop(_client(store, exact=False), store, model="m")
    exact = _tool_loop(_client(store, exact=True), store, model="m")
    assert [c.prompt_token_ids for c in store.calls(plain)] == [c.prompt_token_ids for c in store.calls(exact)]
    assert build_rows(store.calls(plain), rollout_id=plain)[1].merges == 1


def test_through_langchain_and_the_http_server(llm_server: LLMTestServer, store: TraceStore) -> None:
    """The guess demo's framework: ChatOpenAI with a bound tool sends AIMessage.tool_calls back."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool(description="math")
    def calc(query: str) -> str:
        return "42"

    llm = wrap(ChatOpenAI(model=LOOSE, base_url=llm_server.base_url, api_key="-", max_retries=0), store=store,
               exact_history=True).bind_tools([calc])
    with rollout("t", store=store) as r:
        messages: list = [HumanMessage("what is 6*7?")]
        ai = llm.invoke(messages)
        messages += [ai, ToolMessage("42", tool_call_id=ai.tool_calls[0]["id"])]
        final = llm.invoke(messages)
    store.flush()
    assert final.content.startswith("echo:")
    rows, stats = build_rows(store.calls(r.id), rollout_id=r.id)
    assert (len(rows), stats.prefix_breaks, stats.merges) == (1, 0, 1)


def test_through_the_gateway(llm_server: LLMTestServer, store: TraceStore) -> None:
    """`Gateway(exact_history=True)` (`lightning-mw gateway --exact-history`): the same, for an
    agent in another process that points its base URL at a rollout."""
    with Gateway([llm_server.base_url], store, health_interval_s=0, exact_history=True) as gw:
        rid = httpx.post(gw.url + "/rollouts", json={"task_id": "t"}, timeout=30).json()["id"]
        client = openai.OpenAI(base_url=gw.rollout_base_url(rid), api_key="sk-test")
        messages: list[dict] = [{"role": "user", "content": "what is 6*7?"}]
        message = client.chat.completions.create(model=LOOSE, messages=messages, tools=TOOLS) \
            .choices[0].message.model_dump(exclude_none=True)
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"}]
        client.chat.completions.create(model=LOOSE, messages=messages, tools=TOOLS)
        httpx.post(gw.url + f"/rollouts/{rid}/finish", json={"reward": 1.0}, timeout=30).raise_for_status()
    store.flush()
    rows, stats = build_rows(store.calls(rid), rollout_id=rid)
    assert (len(rows), stats.prefix_breaks, stats.merges) == (1, 0, 1)


def test_turns_are_per_rollout_and_unattached_calls_are_left_alone(store: TraceStore) -> None:
    client = _client(store, exact=True)
    first = client.chat.completions.create(model=LOOSE, messages=[{"role": "user", "content": "q"}], tools=TOOLS)
    message = first.choices[0].message.model_dump(exclude_none=True)
    follow = [{"role": "user", "content": "q"}, message,
              {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"}]
    with rollout("t", store=store) as r:  # a turn it never saw: sent as the framework wrote it
        client.chat.completions.create(model=LOOSE, messages=follow, tools=TOOLS)
    store.flush()
    [call] = store.calls(r.id)
    assert call.request["messages"][1]["tool_calls"] and call.prompt_token_ids == tuple(tokenize(render_chat(follow)))


# -- the sampled text, from the bytes of an answer -------------------------------------------

def _chat_body(tokens: list[bytes], *, finish: str = "tool_calls", stop_reason: object = "absent",
               lp: bool = True) -> bytes:
    choice: dict = {"index": 0, "finish_reason": finish, "token_ids": list(range(len(tokens))),
                    "message": {"role": "assistant", "content": None,
                                "tool_calls": [{"id": "call_1", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]}}
    if stop_reason != "absent":
        choice["stop_reason"] = stop_reason
    if lp:
        choice["logprobs"] = {"content": [{"token": t.decode("utf-8", "replace"), "logprob": -0.1, "bytes": list(t)}
                                          for t in tokens]}
    return json.dumps({"id": "x", "choices": [choice], "prompt_token_ids": [1, 2]}).encode()


def _assembled(body: bytes, streaming: bool = False, token_limit: int | None = None,
               eos_ids: frozenset[int] = frozenset()):
    collector = BodyCollector("chat.completions", streaming, None, sampled_text=True,
                              eos=EosHints(token_limit, eos_ids))
    collector.feed(body)
    return collector.result()


@pytest.mark.parametrize(("tokens", "stop_reason", "lp", "expected"), [
    ([b"<tool_call>", b"{}", b"</tool_call>"], "absent", True, "<tool_call>{}</tool_call>"),
    # vLLM counts the EOS that ended the answer among the tokens (stop_reason null): not text
    ([b"<tool_call>", b"{}", b"</tool_call>", b"<|im_end|>"], None, True, "<tool_call>{}</tool_call>"),
    ([b"ab", b"</tool_call>"], "</tool_call>", True, "ab</tool_call>"),  # a stop string: no EOS token
    ([b"\xc3", b"\xa9"], "absent", True, "\u00e9"),  # one character over two tokens, joined as bytes
    ([b"\xc3"], "absent", True, None),  # not UTF-8 as a whole: unknown, the turn goes back as written
    ([b"a"], "absent", False, None),  # no logprobs: unknown
])
def test_sampled_text_of_a_whole_answer(tokens: list[bytes], stop_reason: object, lp: bool,
                                        expected: str | None) -> None:
    assert _assembled(_chat_body(tokens, stop_reason=stop_reason, lp=lp)).sampled_text == expected


CUT = [b"<tool_call>", b'{"n": 6}', b"</tool_call>", b'{"n":']  # a call parsed, then text cut at the limit
# (_chat_body numbers the tokens 0, 1, 2, ...: the last of CUT is ID 3)


@pytest.mark.parametrize(("tokens", "finish", "limit", "eos_ids", "expected"), [
    # vLLM says "tool_calls" whenever its parser found a call, also when the answer was cut at
    # max_tokens: the last token is text, kept (the guess demo's CI run lost a '":' this way)
    (CUT, "tool_calls", 4, frozenset(), '<tool_call>{"n": 6}</tool_call>{"n":'),
    (CUT, "tool_calls", 4, frozenset({7}), '<tool_call>{"n": 6}</tool_call>{"n":'),  # another ID is the EOS
    # at the limit, and the last token is the model's EOS (learnt from an earlier "stop"): it ended it
    (CUT, "tool_calls", 4, frozenset({3}), '<tool_call>{"n": 6}</tool_call>'),
    (CUT, "tool_calls", 5, frozenset(), '<tool_call>{"n": 6}</tool_call>'),  # below the limit: its EOS ended it
    (CUT, "tool_calls", None, frozenset(), '<tool_call>{"n": 6}</tool_call>'),  # no limit asked for: as before
    (CUT, "stop", 4, frozenset(), '<tool_call>{"n": 6}</tool_call>'),  # "stop" at the limit: vLLM saw the EOS first
    (CUT, "length", 4, frozenset({3}), '<tool_call>{"n": 6}</tool_call>{"n":'),  # a cut says so: never an EOS
])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_an_answer_cut_at_the_token_limit_keeps_its_last_token(tokens: list[bytes], finish: str, limit: int | None,
                                                               eos_ids: frozenset[int], expected: str,
                                                               streaming: bool) -> None:
    body = _chat_body(tokens, finish=finish, stop_reason=None)
    if streaming:
        choice = json.loads(body)["choices"][0]
        head = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None, "token_ids": choice["token_ids"][:2],
                "logprobs": {"content": choice["logprobs"]["content"][:2]}}
        tail = {"index": 0, "delta": {"tool_calls": [{"index": 0, **choice["message"]["tool_calls"][0]}]},
                "finish_reason": finish, "stop_reason": None, "token_ids": choice["token_ids"][2:],
                "logprobs": {"content": choice["logprobs"]["content"][2:]}}
        body = b"".join(b"data: " + json.dumps({"id": "x", "choices": [c]}).encode() + b"\n\n" for c in (head, tail)) \
            + b"data: [DONE]\n\n"
    a = _assembled(body, streaming, token_limit=limit, eos_ids=eos_ids)
    assert a.sampled_text == expected
    assert a.eos_id == (3 if expected == '<tool_call>{"n": 6}</tool_call>' else None)  # what a later answer learns


def test_the_token_limit_is_read_from_the_request() -> None:
    assert token_limit({"max_completion_tokens": 48, "max_tokens": 9}) == 48
    assert token_limit({"max_tokens": 9}) == 9
    assert token_limit({"max_tokens": None}) is None
    assert token_limit({"max_tokens": True}) is None and token_limit({"max_tokens": "9"}) is None
    assert token_limit({}) is None


def test_sampled_text_is_read_only_when_asked_for() -> None:
    """Every other captured call skips the work: only exact_history's calls ask for it."""
    collector = BodyCollector("chat.completions", False, None)
    collector.feed(_chat_body([b"<tool_call>", b"{}", b"</tool_call>"]))
    assert collector.result().sampled_text is None


def test_sampled_text_needs_one_logprob_per_token() -> None:
    body = json.loads(_chat_body([b"a", b"b"]))
    body["choices"][0]["token_ids"] = [1, 2, 3]
    assert _assembled(json.dumps(body).encode()).sampled_text is None


def test_sampled_text_of_a_stream() -> None:
    def event(delta: dict, tokens: list[bytes], finish: str | None = None, **extra: object) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": list(range(len(tokens))),
                  "logprobs": {"content": [{"token": "?", "logprob": -0.1, "bytes": list(t)} for t in tokens]},
                  **extra}
        return b"data: " + json.dumps({"id": "x", "choices": [choice]}).encode() + b"\n\n"

    sse = (event({"role": "assistant"}, [b"<tool_call>", b"{}"])
           + event({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}]},
                   [b"\n</tool_call>", b"<|im_end|>"], "tool_calls", stop_reason=None)
           + b"data: [DONE]\n\n")
    a = _assembled(sse, streaming=True)
    assert a.sampled_text == "<tool_call>{}\n</tool_call>"
    turns = SampledTurns()
    turns.remember(a.response, a.sampled_text)
    back = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"}]
    assert turns.restore(back) == [back[0], {"role": "assistant", "content": "<tool_call>{}\n</tool_call>"}, back[2]]
    assert turns.restore(back[:1]) is None  # nothing to restore: the request goes as written
    other = [{"role": "assistant", "tool_calls": [{"id": "call_2", "function": {"name": "f", "arguments": "{}"}}]}]
    assert turns.restore(other) is None


# -- the EOS at exactly the token limit, learnt from the model's earlier answers ---------------

def _vllm_answer(pieces: list[bytes], ids: list[int], finish: str, call_id: str | None) -> dict:
    """A chat answer as vLLM sends one: token IDs, a logprob entry (with its bytes) per token, and
    `stop_reason` null when the EOS ended it; "tool_calls" whenever its parser found a call."""
    text = b"".join(pieces).decode()
    message: dict = {"role": "assistant", "content": None if call_id else text}
    if call_id:
        message["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": "calc", "arguments": "{}"}}]
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "policy", "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "stop_reason": None,
                         "token_ids": ids, "logprobs": {"content": [
                             {"token": t.decode(), "logprob": -0.1, "bytes": list(t)} for t in pieces]}}]}


def _tool_turn_sent_back(store: TraceStore, answers: list[dict], warm_up: bool, **extra: object) -> dict:
    """Through a wrapped client: (an earlier rollout's answer, if `warm_up`), then a rollout's tool call with
    max_tokens 4 and the request after it; returns the assistant turn that request carried."""
    sent: list[dict] = []

    def upstream(request: httpx2.Request) -> httpx2.Response:
        sent.append(json.loads(request.content))
        body = json.dumps(answers[len(sent) - 1]).encode()  # streamed, as a real transport's body is
        return httpx2.Response(200, headers={"content-type": "application/json"}, content=iter([body]))

    http = httpx2.Client(transport=httpx2.MockTransport(upstream))
    client = wrap(openai.OpenAI(base_url="http://vllm.test/v1", api_key="x", http_client=http, max_retries=0),
                  store=store, exact_history=True)
    if warm_up:  # an earlier rollout's answer
        with rollout("earlier", store=store):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    messages: list[dict] = [{"role": "user", "content": "6*7?"}]
    with rollout("t", store=store):
        out = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4,
                                             extra_body=extra or None)
        messages += [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
    return sent[-1]["messages"][1]


def test_an_eos_at_exactly_the_limit_is_known_by_the_id_an_earlier_answer_ended_with(store: TraceStore) -> None:
    """vLLM calls an answer its parser found a call in "tool_calls", cut at max_tokens or ended by
    its EOS: at the limit only the ID tells. An earlier rollout's answer ended with "stop" shows the
    EOS (ID 99); an answer of exactly max_tokens that ends with 99 then goes back without the EOS's text.
    Before any "stop" the same answer counts as cut and keeps it (the one case left ambiguous).
    The upstream is httpx's MockTransport answering vLLM-shaped bodies in order."""
    eos = b"<|im_end|>"
    at_limit = _vllm_answer([b"<tool_call>", b"{}", b"</tool_call>", eos], [10, 11, 12, 99], "tool_calls", "call_1")
    stop = _vllm_answer([b"Hi", eos], [5, 99], "stop", None)
    assert _tool_turn_sent_back(store, [stop, at_limit, stop], warm_up=True) == \
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"}
    assert _tool_turn_sent_back(store, [at_limit, stop], warm_up=False) == \
        {"role": "assistant", "content": "<tool_call>{}</tool_call><|im_end|>"}
    # asked to ignore the EOS, an answer at the limit was cut whatever its last ID
    assert _tool_turn_sent_back(store, [stop, at_limit, stop], warm_up=True, ignore_eos=True) == \
        {"role": "assistant", "content": "<tool_call>{}</tool_call><|im_end|>"}
