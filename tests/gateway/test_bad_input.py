"""Bad input to the gateway's HTTP surface, fuzzed (hypothesis), in process: the raw ASGI app
(tests/gateway/raw_asgi.py) in front of the real test LLM server.

Whatever a client sends, the gateway answers a 4xx with an OpenAI-style JSON error (413 for a
body over `max_body_bytes`, 431 for headers over `max_header_bytes`), never a 5xx; it stays up;
and nothing it was sent is recorded as a training call (checked in the store after each test).
docs/gateway.md ("Bad input") says what answers what; tests/gateway/test_bad_http.py covers
what only a real socket shows.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import assume, example, given
from hypothesis import strategies as st

from lightning_middleware import TraceStore
from lightning_middleware.gateway import Gateway
from lightning_middleware.gateway.requests import proxy_route
from lightning_middleware.testing import LLMTestServer
from lightning_middleware.testing.llm_script import request_fields
from tests.fuzzing import fuzz, tried
from tests.gateway.raw_asgi import Answer, request

BODY_LIMIT = 64 * 1024
HEADER_LIMIT = 16 * 1024
JSON_CT = (b"content-type", b"application/json")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "what is 2+2?"}], "max_tokens": 8}
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}
PROXY_SUFFIXES = ("/v1/chat/completions", "/v1/completions")
TRANSLATED = ("/v1/responses", "/v1/messages")  # other formats, translated to chat completions (docs/formats.md)


@dataclass
class Served:
    """The gateway's app on its own event loop, with one open rollout (`rid`)."""

    gw: Gateway
    loop: asyncio.AbstractEventLoop
    store: TraceStore
    rid: str

    def send(self, method: str, path: str, **kw: Any) -> Answer:
        return self.loop.run_until_complete(request(self.gw.app, method, path, **kw))

    def calls(self) -> int:
        """How many calls the store holds (after the writer's queue is flushed)."""
        self.store.flush()
        with self.store.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM llm_calls")).scalar() or 0)

    def post(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> Answer:
        return self.send("POST", path, headers=[JSON_CT, *(headers or [])], chunks=[body])


@pytest.fixture(scope="module")
def served(llm_server: LLMTestServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    store = TraceStore(f"sqlite:///{tmp_path_factory.mktemp('bad-input') / 'gw.db'}")
    gw = Gateway([llm_server.base_url], store, health_interval_s=0, max_body_bytes=BODY_LIMIT,
                 max_header_bytes=HEADER_LIMIT, policy_version=1)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(gw.startup())
    s = Served(gw, loop, store, "")
    created = s.post("/rollouts", json.dumps({"id": "fuzz-target", "task_id": "t"}).encode())
    assert created.status == 201, created.body
    s.rid = "fuzz-target"
    yield s
    loop.run_until_complete(gw.shutdown())
    loop.close()
    store.close()


@pytest.fixture(autouse=True)
def still_serving(served: Served) -> Iterator[None]:
    """After each test: the gateway answers, the target rollout is untouched, and no call is a
    training call (each fuzz test sends only requests that must not become one)."""
    yield
    assert served.send("GET", "/health").status == 200
    served.store.flush()
    with served.store.engine.connect() as conn:
        training = conn.execute(sa.text("SELECT count(*) FROM llm_calls WHERE is_training")).scalar()
        rewards = conn.execute(sa.text("SELECT count(*) FROM rewards")).scalar()
    assert (training, rewards) == (0, 0)
    target = served.store.get_rollout(served.rid)
    assert target is not None and target.status == "running"


def assert_refused(answer: Answer, *statuses: int) -> dict[str, Any]:
    """A 4xx (one of `statuses` if given) with an OpenAI-style JSON error."""
    assert 400 <= answer.status < 500, (answer.status, answer.body[:500])
    if statuses:
        assert answer.status in statuses, (answer.status, answer.body[:500])
    return answer.error()


def proxy_paths(rid: str) -> st.SearchStrategy[str]:
    return st.sampled_from([p for s in PROXY_SUFFIXES + TRANSLATED for p in (s, f"/rollouts/{rid}{s}")])


def code_of(path: str, error: dict[str, Any]) -> Any:
    """The error's `code`; TRANSLATED for a translated route, whose errors take the caller's format
    (a Responses or Anthropic error: a message, no OpenAI `code`)."""
    return TRANSLATED if path.endswith(TRANSLATED) else error["code"]


def strict_json_object(raw: bytes) -> bool:
    """Is `raw` a JSON object as RFC 8259 has it (UTF-8, no NaN/Infinity, no lone surrogate, what
    the gateway accepts)? The oracle the malformed-body cases are checked against."""
    def constant(name: str) -> Any:
        raise ValueError(name)

    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate (key or value) raises
    except (ValueError, UnicodeError, RecursionError):
        return False
    return isinstance(value, dict)


# --------------------------------------------------------------------------
# Bodies that are not JSON objects
# --------------------------------------------------------------------------

VALID = json.dumps(CHAT).encode()

malformed_bodies = st.one_of(
    st.binary(max_size=300),
    st.integers(0, len(VALID) - 1).map(lambda k: VALID[:k]),  # truncated
    st.tuples(st.integers(0, len(VALID) - 1), st.binary(min_size=1, max_size=4)).map(  # a few bytes changed
        lambda t: VALID[:t[0]] + t[1] + VALID[t[0] + len(t[1]):]),
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]).map(  # not JSON, though Python's json reads them
        lambda c: json.dumps({**CHAT, "temperature": 0.5}).encode().replace(b"0.5", c)),
    st.binary(min_size=1, max_size=3).filter(lambda b: not _utf8(b)).map(  # invalid UTF-8 inside a string
        lambda b: VALID.replace(b"what", b"wh" + b + b"at")),
    st.sampled_from(["utf-16", "utf-32", "utf-8-sig"]).map(lambda enc: json.dumps(CHAT).encode(enc)),
    st.sampled_from([b"\\ud800", b"\\udfff", b"\\ud83d"]).map(lambda s: VALID.replace(b"what", b"wh" + s + b"at")),
    st.sampled_from([b"[]", b"null", b"1", b'"x"', b"true", b"{}{}", b"{", b"}", b""]),
)


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@fuzz(300)
@given(body=malformed_bodies, path=proxy_paths("fuzz-target"))
# Found (each answered 200 and recorded a call: the standard library's parser took what orjson refused).
@example(body=b'{"":"","":[{"":"","":""}],"":NaN}', path="/v1/chat/completions")
@example(body=json.dumps(CHAT).encode("utf-16"), path="/v1/chat/completions")
@example(body=b"\xef\xbb\xbf" + VALID, path="/rollouts/fuzz-target/v1/chat/completions")
@example(body=VALID.replace(b"what", b"wh\\ud800at"), path="/v1/chat/completions")
def test_a_body_that_is_not_a_json_object_is_a_400(served: Served, body: bytes, path: str) -> None:
    assume(not strict_json_object(body))
    tried("gateway: malformed, truncated, non-UTF-8, NaN bodies")
    assert_refused(served.post(path, body), 400)


# --------------------------------------------------------------------------
# A JSON object of the wrong shape: every field of a request with a wrong type
# --------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


def _of_type(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, bool) if bool in types and isinstance(value, bool) else (
        not isinstance(value, bool) and isinstance(value, types))


def wrong_value(types: tuple[type, ...]) -> st.SearchStrategy[Any]:
    return json_values.filter(lambda v: v is not None and not _of_type(v, types))


def wrong_field(endpoint: str) -> st.SearchStrategy[tuple[str, Any]]:
    fields = request_fields(endpoint == "chat")
    return st.sampled_from(sorted(fields)).flatmap(lambda f: wrong_value(fields[f]).map(lambda v: (f, v)))


bad_messages = st.one_of(
    st.lists(json_values.filter(lambda v: not isinstance(v, dict)), min_size=1, max_size=3),
    st.fixed_dictionaries({"role": wrong_value((str,)), "content": st.just("x")}).map(lambda m: [m]),
    st.fixed_dictionaries({"role": st.just("user"), "content": wrong_value((str, list))}).map(lambda m: [m]),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.just("x"),
                           "tool_calls": wrong_value((list,))}).map(lambda m: [m]),
)


@fuzz(150)
@given(endpoint=st.sampled_from(["chat", "completions"]), field=st.data(), per_rollout=st.booleans())
def test_every_field_with_a_wrong_type_is_a_4xx(served: Served, endpoint: str, field: st.DataObject,
                                                  per_rollout: bool) -> None:
    name, value = field.draw(wrong_field(endpoint))
    body = {**(CHAT if endpoint == "chat" else COMPLETION), name: value}
    suffix = PROXY_SUFFIXES[0] if endpoint == "chat" else PROXY_SUFFIXES[1]
    tried("gateway: a request field of the wrong type")
    before = served.calls()
    assert_refused(served.post(f"/rollouts/{served.rid}{suffix}" if per_rollout else suffix,
                               json.dumps(body).encode()))
    # The upstream refused it, and the attempt is kept as a failed call (before, a field the store
    # could not bind, such as a model that is a list, cost the record).
    assert served.calls() == before + 1


@fuzz(60)
@given(messages=bad_messages, stream=st.booleans())
def test_malformed_messages_are_a_4xx(served: Served, messages: list[Any], stream: bool) -> None:
    tried("gateway: malformed messages")
    body = {**CHAT, "messages": messages, "stream": stream}
    assert_refused(served.post(f"/rollouts/{served.rid}/v1/chat/completions", json.dumps(body).encode()))


@fuzz(60)
@given(body=json_values.filter(lambda v: not isinstance(v, dict)), route=st.sampled_from(
    ["/rollouts", "/rollouts/fuzz-target/reward", "/admin/pause", "/admin/resume"]))
def test_the_other_routes_refuse_a_body_that_is_not_an_object(served: Served, body: Any, route: str) -> None:
    tried("gateway: a non-object body to the other routes")
    assert_refused(served.post(route, json.dumps(body).encode()), 400)


not_a_number = json_values.filter(lambda v: isinstance(v, bool) or not isinstance(v, (int, float)))
reward_bodies = st.one_of(
    st.fixed_dictionaries({"value": not_a_number}),
    st.fixed_dictionaries({"value": st.just(1.0), "metadata": wrong_value((dict,)).filter(bool)}),
    st.fixed_dictionaries({"value": st.just(1.0), "name": st.text(min_size=256, max_size=400)}),
)


@fuzz(60)
@given(body=reward_bodies, key=st.none() | st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1,
                                                  max_size=300).map(str.encode))
# found: stored on SQLite, a 503 on PostgreSQL (VARCHAR(255))
@example(body={"value": 1.0, "name": "0" * 256}, key=None)
@example(body={"value": "1"}, key=b"k-1")
def test_a_bad_reward_is_a_400_and_writes_nothing(served: Served, body: dict[str, Any], key: bytes | None) -> None:
    tried("gateway: bad rewards")
    headers = [(b"idempotency-key", key)] if key else []
    assert_refused(served.post(f"/rollouts/{served.rid}/reward", json.dumps(body).encode(), headers), 400)


create_bodies = st.one_of(
    st.fixed_dictionaries({"task_id": wrong_value((str,))}),
    st.fixed_dictionaries({"task_id": st.just(""), "id": st.just("ok-id")}),
    st.fixed_dictionaries({"task_id": st.text(min_size=256, max_size=300)}),
    st.fixed_dictionaries({"task_id": st.just("t"), "mode": json_values.filter(lambda v: v not in ("train", "val"))}),
    st.fixed_dictionaries({"task_id": st.just("t"), "metadata": wrong_value((dict,)).filter(bool)}),
    # A rollout's own policy map (issue 17): not an object, a model name that is no name, a bad default.
    st.fixed_dictionaries({"task_id": st.just("t"), "policies": wrong_value((dict,)).filter(bool)}),
    st.fixed_dictionaries({"task_id": st.just("t"), "policies": st.dictionaries(
        st.text(min_size=1, max_size=20), wrong_value((str,)) | st.text(min_size=256, max_size=300) | st.just(""),
        min_size=1, max_size=3)}),
    st.fixed_dictionaries({"task_id": st.just("t"), "default_policy": wrong_value((str,)) | st.just(" ")}),
)


@fuzz(60)
@given(body=create_bodies)
def test_a_bad_rollout_is_a_400(served: Served, body: dict[str, Any]) -> None:
    tried("gateway: bad rollouts")
    before = len(served.store.query_rollouts())
    assert_refused(served.post("/rollouts", json.dumps(body).encode()), 400)
    assert len(served.store.query_rollouts()) == before  # nothing stored


# --------------------------------------------------------------------------
# Sizes: bodies over the limit, deep nesting, bad Content-Length
# --------------------------------------------------------------------------

@fuzz(30)
@given(size=st.integers(BODY_LIMIT + 1, 4 * BODY_LIMIT), parts=st.integers(1, 20), declared=st.booleans(),
       path=proxy_paths("fuzz-target") | st.sampled_from(["/rollouts", "/rollouts/fuzz-target/reward"]))
def test_a_body_over_the_limit_is_a_413(served: Served, size: int, parts: int, declared: bool, path: str) -> None:
    tried("gateway: bodies over the limit")
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * size}]}).encode()
    step = -(-len(body) // parts)
    chunks = [body[i:i + step] for i in range(0, len(body), step)]
    headers = [JSON_CT, *([(b"content-length", str(len(body)).encode())] if declared else [])]
    assert code_of(path, assert_refused(served.send("POST", path, headers=headers, chunks=chunks), 413)) in (
        "body_too_large", TRANSLATED)


@fuzz(30)
@given(declared=st.one_of(st.integers(BODY_LIMIT + 1, 10**15).map(str),
                          st.text(max_size=10).filter(lambda t: not t.strip().lstrip("+-").isdigit())))
def test_a_bad_or_oversized_content_length_is_refused_before_the_body(served: Served, declared: str) -> None:
    tried("gateway: bad Content-Length")
    answer = served.send("POST", "/v1/chat/completions", chunks=[VALID],
                         headers=[JSON_CT, (b"content-length", declared.encode("utf-8"))])
    assert_refused(answer, 400, 413)


@fuzz(20)
@given(depth=st.integers(1025, 50_000), kind=st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]),
       path=proxy_paths("fuzz-target") | st.sampled_from(["/rollouts", "/rollouts/fuzz-target/reward"]))
def test_nesting_deeper_than_json_allows_is_a_400(served: Served, depth: int, kind: tuple[bytes, bytes],
                                                 path: str) -> None:
    tried("gateway: deeply nested bodies")
    nested = kind[0] * depth + (b"1" if kind[0] == b'{"a":' else b"") + kind[1] * depth
    body = b'{"model": "m", "messages": [], "extra": ' + nested + b"}"
    if len(body) <= BODY_LIMIT:
        assert code_of(path, assert_refused(served.post(path, body), 400)) in ("invalid_json", TRANSLATED)
    else:
        assert_refused(served.post(path, body), 413)


# --------------------------------------------------------------------------
# Routes: unknown paths and methods, odd rollout ids
# --------------------------------------------------------------------------

path_segments = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="/"), max_size=12),
    st.sampled_from(["v1", "rollouts", "chat", "completions", "models", "admin", "health", "..", ".", "%2F", ""]))
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT", "BREW",
                           "get", "POST "])


def served_by(gw: Gateway, method: str, path: str) -> bool:
    """Does `method path` reach a handler (rather than a 404/405)? Those are left out here."""
    from starlette.routing import Match

    if proxy_route(path) is not None:
        return method == "POST"
    sc = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    return any(route.matches(sc)[0] == Match.FULL for route in gw.app.router.routes)


@fuzz(150)
@given(method=METHODS, segments=st.lists(path_segments, max_size=6))
def test_unknown_routes_and_methods_are_a_404_or_405(served: Served, method: str, segments: list[str]) -> None:
    path = "/" + "/".join(segments)
    assume(not served_by(served.gw, method, path))
    tried("gateway: unknown routes and methods")
    answer = served.send(method, path)
    assert answer.status in (404, 405), (method, path, answer.status, answer.body[:300])
    if method != "HEAD":
        answer.error()


ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


def legit_id(rid: str) -> bool:
    """The ids a rollout may have (docs/gateway.md): 1-64 of A-Z a-z 0-9 . _ : -, not only dots."""
    return 0 < len(rid) <= 64 and set(rid) <= ID_CHARS and set(rid) != {"."}


odd_ids = st.one_of(
    st.just(""), st.just("."), st.just(".."), st.just("..."), st.sampled_from(["%2F", "a%2Fb", "%2e%2e", "a b"]),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=20).filter(lambda t: "/" not in t),
    st.text(st.sampled_from("abc.-_:"), min_size=65, max_size=5000),
    st.text(st.characters(codec="utf-8", exclude_categories=["L", "N"]), min_size=1, max_size=10),
)
ROLLOUT_ROUTES = [("POST", "/rollouts/{rid}/v1/chat/completions"), ("POST", "/rollouts/{rid}/v1/completions"),
                  ("GET", "/rollouts/{rid}/v1/models"), ("GET", "/rollouts/{rid}"),
                  ("POST", "/rollouts/{rid}/reward"), ("POST", "/rollouts/{rid}/finish"),
                  ("POST", "/rollouts/{rid}/fail")]


@fuzz(200)
@given(rid=odd_ids, route=st.sampled_from(ROLLOUT_ROUTES), encoded_slash=st.booleans())
@example(rid="", route=("GET", "/rollouts/{rid}"), encoded_slash=False)  # found: a 307 redirect to /rollouts
def test_odd_rollout_ids_in_the_path_are_a_4xx(served: Served, rid: str, route: tuple[str, str],
                                               encoded_slash: bool) -> None:
    assume(rid != served.rid)
    tried("gateway: odd per-rollout paths")
    method, template = route
    path = template.replace("{rid}", rid)
    # A percent-encoded slash arrives decoded in `path` (uvicorn's behaviour), encoded in `raw_path`.
    raw = template.replace("{rid}", rid.replace("/", "%2F")).encode() if encoded_slash else None
    if encoded_slash:
        path = path.replace("%2F", "/")
    body = json.dumps(CHAT if "completions" in template else {"value": 1.0}).encode()
    answer = served.send(method, path, headers=[JSON_CT], chunks=[body], raw_path=raw)
    assert_refused(answer, 400, 404, 405)


@fuzz(100)
@given(rid=odd_ids.filter(lambda r: not legit_id(r)))
@example(rid=".")  # found: created; its base URL /rollouts/./v1 is /v1 to a client (the calls go unattached)
@example(rid="..")
@example(rid="abc\n")  # found: created (`$` matches before a final newline): a newline in URLs and log lines
def test_a_rollout_cannot_be_created_with_an_odd_id(served: Served, rid: str) -> None:
    tried("gateway: odd ids to POST /rollouts")
    assert assert_refused(served.post("/rollouts", json.dumps({"id": rid, "task_id": "t"}).encode()),
                          400)["code"] == "bad_rollout_id"


# --------------------------------------------------------------------------
# Headers: CR/LF and other control characters, bad names, oversized
# --------------------------------------------------------------------------

TOKEN_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~")  # RFC 9110
CONTROL = [c for c in map(chr, range(32)) if c != "\t"] + ["\x7f"]
injected = st.tuples(st.text(max_size=8), st.sampled_from(CONTROL), st.text(max_size=8)).map("".join)
header_names = st.sampled_from(["x-custom", "user-agent", "x-rollout-id", "idempotency-key",
                                "x-stainless-retry-count", "x-agent-name", "openai-organization"])


@fuzz(100)
@given(name=header_names, value=injected, path=proxy_paths("fuzz-target"))
@example(name="x-custom", value="\x00", path="/v1/chat/completions")  # found: forwarded upstream, a 200
@example(name="x-custom", value="a\r\nx-injected: 1", path="/v1/chat/completions")
def test_a_header_value_with_control_characters_is_a_400(served: Served, name: str, value: str, path: str) -> None:
    tried("gateway: CR/LF and control characters in header values")
    answer = served.post(path, VALID, [(name.encode(), value.encode("utf-8"))])
    assert assert_refused(answer, 400)["code"] in ("bad_header", "bad_rollout_id", "rollout_mismatch")


@fuzz(60)
@given(name=st.text(min_size=1, max_size=10).filter(lambda n: not set(n) <= TOKEN_CHARS),
       path=proxy_paths("fuzz-target"))
@example(name=":", path="/v1/chat/completions")  # found: forwarded upstream, a 200
@example(name="\x1f", path="/v1/chat/completions")
def test_a_header_name_that_is_no_token_is_a_400(served: Served, name: str, path: str) -> None:
    tried("gateway: header names that are not HTTP tokens")
    answer = served.post(path, VALID, [(name.encode("utf-8"), b"v")])
    assert assert_refused(answer, 400)["code"] == "bad_header"


@fuzz(20)
@given(size=st.integers(HEADER_LIMIT + 1, 8 * HEADER_LIMIT), count=st.integers(1, 50),
       path=proxy_paths("fuzz-target") | st.sampled_from(["/rollouts", "/admin/state", "/nowhere"]))
@example(size=HEADER_LIMIT + 1, count=1, path="/rollouts")  # found: no limit at all (httptools has none)
def test_headers_over_the_limit_are_a_431(served: Served, size: int, count: int, path: str) -> None:
    tried("gateway: oversized headers")
    each = -(-size // count)
    headers = [(f"x-big-{i}".encode(), b"a" * each) for i in range(count)]
    answer = served.post(path, VALID, headers)
    assert assert_refused(answer, 431)["code"] == "headers_too_large"
