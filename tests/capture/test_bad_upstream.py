"""What `wrap()` receives from a broken upstream, fuzzed (hypothesis): a non-JSON body with 200,
JSON of the wrong shape, a truncated body, a non-JSON or malformed SSE stream, odd headers.

The upstream is httpx's own MockTransport (not our code) answering scripted bytes; the client is
the real openai SDK or a bare httpx client, wrapped. Each case is sent twice, through an unwrapped
client and a wrapped one, and they must agree: the agent gets exactly what the server sent (or
the SDK's own error), minus only the fields capture itself asked for, and recording never raises
into the agent. The store then holds exactly one call for it, never a training call, marked
failed (`error`) or partial.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import openai
import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.testing import llm_http_client
from lightning_middleware.testing.llm_script import reply
from tests.fuzzing import fuzz, tried

URL = "http://llm.test/v1"
MSGS = [{"role": "user", "content": "what is 2+2?"}]
CHAT = {"model": "m", "messages": MSGS, "max_tokens": 8}
INJECTED = {"return_token_ids": True, "logprobs": True}  # what capture adds to a training rollout's request


@dataclass(frozen=True)
class Scripted:
    """What the upstream answers: a status, headers, and the body in chunks."""

    status: int
    headers: tuple[tuple[str, str], ...]
    chunks: tuple[bytes, ...]

    def handler(self, module: Any, *, asynchronous: bool = False) -> Callable[[Any], Any]:
        async def chunks() -> AsyncIterator[bytes]:
            for chunk in self.chunks:
                yield chunk

        def handle(request: Any) -> Any:
            body = chunks() if asynchronous else iter(self.chunks)
            return module.Response(self.status, headers=list(self.headers), content=body)
        return handle

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path_factory.mktemp('bad-upstream') / 'traces.db'}")
    yield s
    s.close()


# --------------------------------------------------------------------------
# What the broken upstream sends
# --------------------------------------------------------------------------

def good_answer(stream: bool) -> tuple[bytes, ...]:
    """A real answer (the test LLM's, with token IDs and logprobs), as the chunks a server sends."""
    answer = reply("/v1/chat/completions", {}, json.dumps({**CHAT, **INJECTED, "stream": stream}).encode())
    return answer.events if stream else (answer.json_bytes(),)


def cut(body: bytes, parts: st.DataObject) -> tuple[bytes, ...]:
    """`body` in the chunks the network might deliver it in."""
    points = sorted(parts.draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=4)))
    bounds = [0, *points, len(body)]
    return tuple(body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
not_a_list_of_ints = json_values.filter(lambda v: v and not (isinstance(v, list) and all(
    isinstance(t, int) and not isinstance(t, bool) and -(2**31) <= t < 2**31 for t in v)))
BROKEN_FIELDS = {  # a field of a real answer, and what makes it no answer a trainer can use
    "choices": json_values.filter(lambda v: not (isinstance(v, list) and v and isinstance(v[0], dict))),
    "prompt_token_ids": not_a_list_of_ints | st.lists(st.integers(2**31, 2**70), min_size=1, max_size=3),
    "token_ids": not_a_list_of_ints | st.lists(st.integers(2**31, 2**70), min_size=1, max_size=3),
    "message": json_values.filter(lambda v: not isinstance(v, dict)),
    "finish_reason": json_values.filter(lambda v: v is not None and not isinstance(v, str)),
}
broken_logprobs = st.one_of(  # read leniently: a malformed block costs the call its logprobs, not its record
    json_values.filter(lambda v: bool(v) and not isinstance(v, dict)),
    st.fixed_dictionaries({"content": json_values.filter(lambda v: v is not None and not isinstance(v, list))}),
    st.fixed_dictionaries({"content": st.lists(json_values.filter(
        lambda v: not (isinstance(v, dict) and type(v.get("logprob")) in (int, float))), min_size=1, max_size=3)}))


def broken_json(body: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """A real answer with one field (top level, or in its first choice) replaced."""
    out = json.loads(json.dumps(body))
    if field in ("choices", "prompt_token_ids"):
        out[field] = value
    else:
        out["choices"][0][field] = value
    return out


@st.composite
def garbage_json_bodies(draw: st.DrawFn) -> bytes:
    """A 200 whose body is JSON of the wrong shape: not an object, no usable choices, broken tokens."""
    kind = draw(st.sampled_from(["value", "object", "field"]))
    if kind == "value":
        return json.dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))).encode()
    if kind == "object":
        return json.dumps(draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k != "choices"), json_values,
                                               max_size=4))).encode()
    field = draw(st.sampled_from(sorted(BROKEN_FIELDS)))
    value = draw(BROKEN_FIELDS[field])
    return json.dumps(broken_json(json.loads(good_answer(False)[0]), field, value)).encode()


sse_lines = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=30).map(lambda t: f"data: {t}".encode()),
    json_values.map(lambda v: b"data: " + json.dumps(v).encode()),
    st.sampled_from([b"data: [DONE]", b"data:", b"event: error", b": keep-alive", b"", b"data: {", b"retry: x",
                     b'data: {"error": {"message": "overloaded"}}', b'data: {"choices": 5}',
                     b'data: {"choices": [{"delta": 5}]}', b'data: {"choices": [{"delta": {"tool_calls": 5}}]}',
                     b'data: {"choices": [{"token_ids": "abc"}]}', b'data: {"choices": [{"index": "x"}]}',
                     b'data: {"prompt_token_ids": 7, "choices": []}']),
)


breaking_events = st.one_of(  # an event no completion stream has: not JSON, not an object, an error, a broken chunk
    st.text(max_size=30).filter(lambda t: t.strip() != "[DONE]" and as_object(t.encode()) is None).map(
        lambda t: f"data: {t}".encode()),
    st.sampled_from([b'data: {"error": {"message": "overloaded"}}', b'data: {"choices": 5}', b"data: {",
                     b'data: {"choices": [{"delta": 5}]}', b'data: {"choices": [{"delta": {"tool_calls": 5}}]}',
                     b'data: {"choices": [{"index": 0, "token_ids": "abc"}]}', b'data: {"choices": [7]}',
                     b'data: {"prompt_token_ids": 7}']),  # (a malformed logprobs block is not: see the last test)
)


@st.composite
def garbage_streams(draw: st.DrawFn) -> bytes:
    """An event stream that is no completion: random lines, malformed events, a real one cut short
    or with a broken event spliced in."""
    kind = draw(st.sampled_from(["lines", "truncated", "spliced"]))
    real = b"".join(good_answer(True))
    if kind == "lines":
        sep = draw(st.sampled_from([b"\n", b"\n\n", b"\r\n", b"\r\n\r\n"]))
        return sep.join(draw(st.lists(sse_lines, min_size=1, max_size=8)))
    if kind == "truncated":
        return real[:draw(st.integers(0, real.rindex(b'"finish_reason": "')))]  # before the last chunk ends it
    events = real.split(b"\n\n")
    at = draw(st.integers(0, len(events) - 2))
    return b"\n\n".join([*events[:at], draw(breaking_events), *events[at:]])


CONTENT_TYPES = st.sampled_from(["application/json", "text/event-stream", "text/plain", "text/html",
                                 "application/json; charset=utf-8", ""])


@st.composite
def broken_answers(draw: st.DrawFn) -> Scripted:
    """Any broken answer: a body of random bytes, wrong-shape JSON, a truncated real body, or a
    broken stream, under any status and content type."""
    kind = draw(st.sampled_from(["bytes", "json", "truncated", "stream"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=200))
    elif kind == "json":
        body = draw(garbage_json_bodies())
    elif kind == "truncated":
        real = good_answer(False)[0]
        body = real[:draw(st.integers(0, len(real) - 1))]
    else:
        body = draw(garbage_streams())
    ctype = draw(CONTENT_TYPES) if kind in ("bytes", "truncated") else (
        "text/event-stream" if kind == "stream" else "application/json")
    status = draw(st.sampled_from([200, 200, 200, 201, 400, 404, 422, 500, 503]))
    headers = [("content-type", ctype)] if ctype else []
    if draw(st.booleans()):  # what an upstream gateway would stamp, here anything
        headers.append(("x-lightning-policy-version", draw(st.sampled_from(["7", "-1", "x", str(2**40), "1e3"]))))
    return Scripted(status, tuple(headers), cut(body, draw(st.data())))


# --------------------------------------------------------------------------
# The two sides: unwrapped and wrapped, and what the store holds after
# --------------------------------------------------------------------------

def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the outcome compared is the exception itself
        return type(exc).__name__, str(exc)


def the_call(store: TraceStore, rid: str, scripted: Scripted) -> None:
    """Exactly one call recorded, never a training call, and marked failed or partial."""
    store.flush()
    calls = store.calls(rid)
    assert len(calls) == 1, calls
    [call] = calls
    assert not call.is_training, call
    assert call.status_code == scripted.status
    if scripted.ok:
        assert call.error is not None or call.partial, call
    else:
        assert call.error is not None and call.error.startswith(f"HTTP {scripted.status}"), call.error


def sdk_call(client: Any, stream: bool) -> Any:
    if not stream:
        return client.chat.completions.create(**CHAT).model_dump()
    with client.chat.completions.create(**CHAT, stream=True) as chunks:  # closed however the loop ends
        return [chunk.model_dump() for chunk in chunks]


def sdk_client(scripted: Scripted) -> openai.OpenAI:
    http = httpx2.Client(transport=httpx2.MockTransport(scripted.handler(httpx2)))
    return openai.OpenAI(base_url=URL, api_key="unused", http_client=http, max_retries=0)


JSON_CT, SSE_CT = (("content-type", "application/json"),), (("content-type", "text/event-stream"),)
REAL = json.loads(good_answer(False)[0])


@fuzz(150)
@given(scripted=broken_answers(), stream=st.booleans())
# Found: a finish_reason that is a list cost the whole record (SQLite refused the row); `{}` and a stream of
# only [DONE] were recorded as if answered, with no error.
@example(scripted=Scripted(200, JSON_CT, (json.dumps(broken_json(REAL, "finish_reason", [])).encode(),)),
         stream=False)
@example(scripted=Scripted(200, JSON_CT, (b"{}",)), stream=False)
@example(scripted=Scripted(200, SSE_CT, (b"data:[DONE]",)), stream=False)
@example(scripted=Scripted(200, SSE_CT, (b"data:null\n\n",)), stream=True)
def test_the_openai_sdk_sees_what_the_server_sent(store: TraceStore, scripted: Scripted, stream: bool) -> None:
    tried("wrap: broken answers to the openai SDK")
    expected = outcome(lambda: sdk_call(sdk_client(scripted), stream))
    client = wrap(sdk_client(scripted), store=store, inject_token_ids=False)
    with rollout("t", store=store) as r:
        got = outcome(lambda: sdk_call(client, stream))
    assert got == expected
    the_call(store, r.id, scripted)


@fuzz(40)
@given(scripted=broken_answers())
@example(scripted=Scripted(200, SSE_CT, (b"data:{}\ndata:[DONE]",)))  # found: recorded as answered
def test_the_async_openai_sdk_sees_what_the_server_sent(store: TraceStore, scripted: Scripted) -> None:
    tried("wrap: broken answers to the async openai SDK")

    def client() -> openai.AsyncOpenAI:
        http = httpx2.AsyncClient(transport=httpx2.MockTransport(scripted.handler(httpx2, asynchronous=True)))
        return openai.AsyncOpenAI(base_url=URL, api_key="unused", http_client=http, max_retries=0)

    async def call(c: openai.AsyncOpenAI) -> tuple[str, Any]:
        try:
            return "ok", (await c.chat.completions.create(**CHAT)).model_dump()
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)

    expected = asyncio.run(call(client()))
    wrapped = wrap(client(), store=store, inject_token_ids=False)

    async def in_rollout() -> tuple[tuple[str, Any], str]:
        with rollout("t", store=store) as r:
            return await call(wrapped), r.id

    got, rid = asyncio.run(in_rollout())
    assert got == expected
    the_call(store, rid, scripted)


# --------------------------------------------------------------------------
# A bare httpx client, with injection on: the body is the server's, minus what capture asked for
# --------------------------------------------------------------------------

def without_injected(obj: dict[str, Any]) -> dict[str, Any]:
    """The oracle for what capture removes from an answer to the fields it added (docs/adapters.md):
    the token ID fields, and logprobs back to null."""
    out = {k: v for k, v in obj.items() if k != "prompt_token_ids"}
    if isinstance(out.get("choices"), list):
        out["choices"] = [{k: (None if k == "logprobs" else v) for k, v in c.items()
                           if k not in ("token_ids", "prompt_token_ids")} if isinstance(c, dict) else c
                          for c in out["choices"]]
    return out


def as_object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def same_but_injected(sent: bytes, got: bytes, ctype: str) -> bool:
    """`got` is `sent`, or (a JSON object / SSE events of JSON objects) the same minus injected fields."""
    if got == sent:
        return True
    if "text/event-stream" in ctype:
        theirs, ours = sent.split(b"\n\n"), got.split(b"\n\n")
        return len(theirs) == len(ours) and all(
            a == b or (a.startswith(b"data: {") and (obj := as_object(a[6:])) is not None
                       and without_injected(obj) == as_object(b[6:]))
            for a, b in zip(theirs, ours))
    obj = as_object(sent)
    return obj is not None and without_injected(obj) == as_object(got)


def raw_post(client: httpx.Client, stream: bool) -> tuple[int, bytes]:
    with client.stream("POST", URL + "/chat/completions", json={**CHAT, "stream": stream}) as resp:
        return resp.status_code, b"".join(resp.iter_raw())


@fuzz(150)
@given(scripted=broken_answers(), stream=st.booleans())
@example(scripted=Scripted(200, JSON_CT, (b'{"choices": 5}',)), stream=False)  # found: a TypeError raised
@example(scripted=Scripted(200, SSE_CT, (b'data: {"choices": 5}\n\n',)), stream=True)  # into the agent
@example(scripted=Scripted(200, SSE_CT, (b'data: {"a": 1}\n\ndata: {"b": 2}\n\n\n', b'\n\n\n\x00\n\ndata: {}')),
         stream=False)  # found: the rewritten event lost the odd newline after its JSON
def test_a_wrapped_httpx_client_gets_the_servers_bytes(store: TraceStore, scripted: Scripted, stream: bool) -> None:
    tried("wrap: broken answers to a bare httpx client, injection on")
    expected = outcome(lambda: raw_post(httpx.Client(transport=httpx.MockTransport(scripted.handler(httpx))), stream))
    client = wrap(httpx.Client(transport=httpx.MockTransport(scripted.handler(httpx))), store=store)
    with rollout("t", store=store) as r:  # a training rollout: return_token_ids and logprobs injected
        got = outcome(lambda: raw_post(client, stream))
    assert got[0] == expected[0]
    if got[0] == "ok":
        ctype = dict(scripted.headers).get("content-type", "")
        assert got[1][0] == expected[1][0] and same_but_injected(expected[1][1], got[1][1], ctype)
    the_call(store, r.id, scripted)


@fuzz(60)
@given(body=st.binary(max_size=300), parts=st.data(), ctype=CONTENT_TYPES, status=st.sampled_from([200, 400, 500]))
def test_random_bytes_never_break_the_agent(store: TraceStore, body: bytes, parts: st.DataObject, ctype: str,
                                            status: int) -> None:
    tried("wrap: random bytes under any status and content type")
    scripted = Scripted(status, (("content-type", ctype),) if ctype else (), cut(body, parts))
    client = wrap(httpx.Client(transport=httpx.MockTransport(scripted.handler(httpx))), store=store)
    with rollout("t", store=store) as r:
        got = raw_post(client, stream=False)
    assert got[0] == status and same_but_injected(body, got[1], ctype)
    the_call(store, r.id, scripted)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_too_deep_to_rewrite_reaches_the_agent_untouched(store: TraceStore, stream: bool) -> None:
    """orjson reads 1024 levels but writes 254, the standard library ~1000: an answer in between used
    to reach the agent as the store's stand-in (`{"lightning_unstorable": ...}`) instead of itself."""
    deep = b"[" * 1020 + b"]" * 1020
    chunk = b'{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "x": ' + deep + b"}"
    body = b"data: " + chunk + b"\n\ndata: [DONE]\n\n" if stream else chunk.replace(b'"delta": {}',
                                                                                    b'"message": {}')
    scripted = Scripted(200, SSE_CT if stream else JSON_CT, (body,))
    client = wrap(httpx.Client(transport=httpx.MockTransport(scripted.handler(httpx))), store=store)
    with rollout("t", store=store) as r:
        status, got = raw_post(client, stream)
    assert (status, got) == (200, body)
    store.flush()
    assert len(store.calls(r.id)) == 1


def test_a_stream_let_go_unclosed_is_recorded_when_released(store: TraceStore) -> None:
    """An agent that stops reading a stream and never closes it (an exception in its loop, a
    `break` outside `with`): the attempt is recorded, as partial, once the stream is released.
    Before, on a bare httpx client nothing recorded it at all (the openai SDK closes it itself)."""
    client = wrap(llm_http_client(httpx), store=store)
    with rollout("t", store=store) as r:
        request = client.build_request("POST", URL + "/chat/completions", json={**CHAT, "stream": True})
        response = client.send(request, stream=True)
        body = response.iter_raw()
        next(body)
        del body, response
        gc.collect()  # released here rather than whenever the collector runs
    store.flush()
    [call] = store.calls(r.id)
    assert call.partial and not call.is_training and call.stream


def with_logprobs(stream: bool, logprobs: Any) -> bytes:
    """A real answer whose choice 0 has `logprobs` (streamed: in the first chunk with tokens)."""
    if not stream:
        return json.dumps(broken_json(REAL, "logprobs", logprobs)).encode()
    events = list(good_answer(True))
    at = next(i for i, e in enumerate(events) if b'"token_ids"' in e)
    chunk = json.loads(events[at][6:])
    chunk["choices"][0]["logprobs"] = logprobs
    events[at] = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return b"".join(events)


def streamed_token_ids() -> list[int]:
    return [t for e in good_answer(True) if e.startswith(b"data: {")
            for c in json.loads(e[6:]).get("choices", []) for t in c.get("token_ids") or []]


@fuzz(40)
@given(logprobs=broken_logprobs, stream=st.booleans())
@example(logprobs="x", stream=True)  # found: the record was lost (an AttributeError on the writer thread)
def test_malformed_logprobs_cost_the_call_only_its_logprobs(store: TraceStore, logprobs: Any, stream: bool) -> None:
    tried("wrap: malformed logprobs blocks")
    scripted = Scripted(200, SSE_CT if stream else JSON_CT, (with_logprobs(stream, logprobs),))
    client = wrap(httpx.Client(transport=httpx.MockTransport(scripted.handler(httpx))), store=store)
    with rollout("t", store=store) as r:
        assert raw_post(client, stream=stream)[0] == 200
    store.flush()
    [call] = store.calls(r.id)
    assert call.is_training and call.error is None and call.logprobs is None
    expected = streamed_token_ids() if stream else REAL["choices"][0]["token_ids"]
    assert list(call.completion_token_ids) == expected
