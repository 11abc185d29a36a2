"""Bad input that only a real server shows: the gateway on uvicorn (httptools, as deployed), sent
raw bytes over a socket. Oversized headers (httptools has no limit of its own: the gateway's
431), requests that are not HTTP (uvicorn's own plain-text 400, before any app), odd paths
as a client really sends them (percent-encoded), and random request heads (hypothesis).

Invariants: never a 5xx; every answer the gateway itself gives is JSON; it stays up; and
nothing is recorded as a training call.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from lightning_middleware import TraceStore
from lightning_middleware.gateway import Gateway
from lightning_middleware.testing import LLMTestServer
from tests.fuzzing import fuzz, tried

BODY_LIMIT = 64 * 1024
HEADER_LIMIT = 16 * 1024
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


@dataclass(frozen=True)
class Reply:
    status: int | None  # None: the connection closed with no answer
    headers: dict[str, str]
    body: bytes

    def json_error(self) -> dict:
        assert self.headers.get("content-type", "").startswith("application/json"), self
        return json.loads(self.body)["error"]


def exchange(port: int, data: bytes, *, half_close: bool = False, timeout: float = 5.0) -> Reply:
    """Send raw bytes; read the answer until the server closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:  # no more bytes are coming: an incomplete request ends here
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed mid-send (it refused what it had read)
            pass
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return parse(received)


def parse(raw: bytes) -> Reply:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return Reply(None, {}, raw)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return Reply(int(parts[1]), headers, body)


def dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out


def http(method: str, path: bytes, headers: list[bytes], body: bytes = b"") -> bytes:
    lines = [method.encode() + b" " + path + b" HTTP/1.1", b"host: gateway", b"connection: close", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    return http("POST", path, [b"content-type: application/json", b"content-length: %d" % len(body), *extra], body)


@pytest.fixture(scope="module")
def live(llm_server: LLMTestServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    store = TraceStore(f"sqlite:///{tmp_path_factory.mktemp('bad-http') / 'gw.db'}")
    with Gateway([llm_server.base_url], store, health_interval_s=0, max_body_bytes=BODY_LIMIT,
                 max_header_bytes=HEADER_LIMIT) as gw:
        reply = exchange(gw.port, post(b"/rollouts", b'{"id": "sock-target", "task_id": "t"}'))
        assert reply.status == 201, reply
        yield gw
    store.close()


@pytest.fixture(autouse=True)
def still_serving(live: Gateway) -> Iterator[None]:
    yield
    health = exchange(live.port, http("GET", b"/health", []))
    assert health.status == 200 and json.loads(health.body)["ok"] is True
    live.store.flush()
    with live.store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM llm_calls WHERE is_training")).scalar() == 0


def assert_refused(reply: Reply, *statuses: int) -> Reply:
    assert reply.status is None or 400 <= reply.status < 500, reply
    if statuses:
        assert reply.status in statuses, reply
    return reply


@pytest.mark.parametrize("headers", [
    [b"x-big: " + b"a" * (HEADER_LIMIT + 1)],
    [b"x-big: " + b"a" * 1_000_000],
    [b"x-h%d: %s" % (i, b"v" * 200) for i in range(200)],
], ids=["just over", "1 MB", "200 headers"])
@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/rollouts/sock-target/v1/chat/completions",
                                  b"/rollouts", b"/health", b"/nowhere"])
def test_oversized_headers_are_a_431(live: Gateway, headers: list[bytes], path: bytes) -> None:
    reply = assert_refused(exchange(live.port, post(path, CHAT, *headers)), 431)
    assert reply.json_error()["code"] == "headers_too_large"


NOT_HTTP = {
    "garbage": b"GARBAGE\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "CR in a value": b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-a: a\rb\r\n\r\n",
    "header injection": b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: a\r\nx-injected\r\n\r\n",
    "NUL in a value": b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\n\r\n",
    "control in a value": b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: a\x01b\r\n\r\n",
    "space in a name": b"GET /health HTTP/1.1\r\nhost: x\r\nx a: b\r\n\r\n",
    "non-ASCII target": b"GET /\xff\xfe HTTP/1.1\r\nhost: x\r\n\r\n",
    "bad Content-Length": post(b"/v1/chat/completions", CHAT).replace(b"content-length: ", b"content-length: x"),
    "negative Content-Length": post(b"/v1/chat/completions", CHAT).replace(b"content-length: ", b"content-length: -"),
    "two Content-Lengths": post(b"/v1/chat/completions", CHAT, b"content-length: 3"),
    "bad chunk size": http("POST", b"/v1/chat/completions", [b"transfer-encoding: chunked"], b"zz\r\n{}\r\n0\r\n\r\n"),
    "TE and CL": post(b"/v1/chat/completions", CHAT, b"transfer-encoding: chunked"),
}


@pytest.mark.parametrize("raw", NOT_HTTP.values(), ids=NOT_HTTP.keys())
def test_what_is_not_http_gets_a_400_and_the_gateway_stays_up(live: Gateway, raw: bytes) -> None:
    assert_refused(exchange(live.port, raw))


def test_a_body_cut_short_is_no_call(live: Gateway) -> None:
    raw = post(b"/rollouts/sock-target/v1/chat/completions", CHAT)
    assert_refused(exchange(live.port, raw[:-5], half_close=True))


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_a_413_on_the_wire(live: Gateway, chunked: bool) -> None:
    body = b'{"model": "m", "prompt": "' + b"x" * (BODY_LIMIT + 1) + b'"}'
    if chunked:
        pieces = [body[i:i + 8192] for i in range(0, len(body), 8192)]
        encoded = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        raw = http("POST", b"/v1/completions", [b"content-type: application/json", b"transfer-encoding: chunked"],
                   encoded)
    else:
        raw = post(b"/v1/completions", body)
    assert assert_refused(exchange(live.port, raw), 413).json_error()["code"] == "body_too_large"


ODD_PATHS = [b"/rollouts/a%2Fb/v1/chat/completions", b"/rollouts/%2e%2e/v1/chat/completions",
             b"/rollouts/../v1/chat/completions", b"/rollouts/./v1/completions", b"/rollouts/%00/v1/chat/completions",
             b"/rollouts/%ff%fe/v1/chat/completions", b"/rollouts//v1/chat/completions",
             b"/rollouts/" + b"a" * 5000 + b"/v1/chat/completions", b"/rollouts/%E2%80%AE/v1/completions",
             b"/rollouts/sock-target%0d%0ax-injected:%201/v1/chat/completions", b"/rollouts/", b"/v1/chat/completions/",
             b"//v1/chat/completions", b"/%2e%2e/v1/chat/completions"]


@pytest.mark.parametrize("path", ODD_PATHS)
def test_odd_paths_on_the_wire_are_a_json_4xx(live: Gateway, path: bytes) -> None:
    reply = assert_refused(exchange(live.port, post(path, CHAT)), 400, 404, 405)
    assert reply.json_error()["message"]


request_heads = st.tuples(
    st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD", b"OPTIONS", b"G\x00T", b""]) | st.binary(max_size=8),
    st.sampled_from([b"/v1/chat/completions", b"/rollouts/sock-target/v1/completions", b"/health", b"*"])
    | st.binary(max_size=40),
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b"HTTP/1.1 x", b""]),
    st.lists(st.binary(max_size=40), max_size=5),
    st.binary(max_size=100),
    st.booleans(),
)


@fuzz(100)
@given(head=request_heads)
def test_random_request_heads_never_get_a_5xx(live: Gateway, head: tuple) -> None:
    tried("gateway socket: random request heads")
    method, target, version, header_lines, body, half_close = head
    raw = b"\r\n".join([method + b" " + target + b" " + version, b"host: x", b"connection: close", *header_lines]) \
        + b"\r\n\r\n" + body
    reply = exchange(live.port, raw, half_close=half_close, timeout=2.0)
    assert reply.status is None or reply.status < 500, reply
