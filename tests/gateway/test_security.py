"""The gateway's security guarantees (docs/gateway.md, "Security"), in process (httpx's ASGI
transport) against the real test LLM server.

The routes are taken from the app itself (the raw proxy handler's `proxy_paths()` and the
Starlette router's routes), so a route added later is checked by these tests without editing
them: with a token, only `PUBLIC` may answer without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import httpx2
import openai
import pytest
import sqlalchemy as sa

from lightning_middleware import TraceStore, rollout, wrap
from lightning_middleware.asgi.auth import check_bearer, rollout_token, tokens_match
from lightning_middleware.asgi.error_replies import HTTPError
from lightning_middleware.gateway import Gateway, GatewayApp, GatewayConfigError
from lightning_middleware.gateway.requests import proxy_paths, proxy_route
from lightning_middleware.records import SANDBOX_BREACH
from lightning_middleware.testing import TEST_BASE_URL, LLMTestServer, llm_http_client
from lightning_middleware.testing.secret_scan import scan_tree

TOKEN = "gw-Sec-7f3a9c21"
AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]
# The labelling page holds no data (its API, under /review/api, takes the token like the rest).
PUBLIC = {("GET", "/health"), ("HEAD", "/health"), ("GET", "/review"), ("HEAD", "/review")}
# Must be among the walked routes: the walk cannot silently miss what the issue names.
WRITES = {("POST", "/rollouts"), ("POST", "/rollouts/{rid}/reward"), ("POST", "/rollouts/{rid}/finish"),
          ("POST", "/rollouts/{rid}/fail"), ("POST", "/admin/pause"), ("POST", "/admin/resume"),
          ("GET", "/admin/state"), ("POST", "/v1/chat/completions"), ("POST", "/rollouts/{rid}/v1/completions"),
          ("POST", "/v1/responses"), ("POST", "/rollouts/{rid}/v1/messages")}
LOOPBACK, OFF_LOOPBACK = ("127.0.0.1", 50000), ("203.0.113.7", 40000)  # the latter: TEST-NET-3, another machine
CHAT = {"model": "m", "messages": [{"role": "user", "content": "what is 2+2?"}], "max_tokens": 8}
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}
RESPONSES = {"model": "m", "input": "what is 2+2?", "max_output_tokens": 8}  # translated to chat completions
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "what is 2+2?"}]}
BODIES = {  # a body each route answers 2xx to (others get {})
    "/v1/chat/completions": CHAT, "/rollouts/{rid}/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION, "/rollouts/{rid}/v1/completions": COMPLETION,
    "/v1/responses": RESPONSES, "/rollouts/{rid}/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES, "/rollouts/{rid}/v1/messages": MESSAGES,
    "/rollouts": {"task_id": "t"}, "/rollouts/{rid}/reward": {"value": 1.0},
    "/admin/pause": {"wait": True, "timeout": 5}, "/admin/resume": {"policy_version": 3},
    "/review/api/rollouts/{rid}/score": {"score": 0.5}, "/review/api/compare": {"a": "{rid}", "b": "{other}",
                                                                               "winner": "tie"},
}
WRONG_AUTH: dict[str, list[tuple[bytes, bytes]]] = {
    "none": [],
    "empty bearer": [(b"authorization", b"Bearer ")],
    "wrong, same length": [(b"authorization", b"Bearer " + b"x" * len(TOKEN))],
    "a prefix of the token": [(b"authorization", f"Bearer {TOKEN[:-1]}".encode())],
    "the token and more": [(b"authorization", f"Bearer {TOKEN}0".encode())],
    "another case": [(b"authorization", f"Bearer {TOKEN.swapcase()}".encode())],
    "no scheme": [(b"authorization", TOKEN.encode())],
    "another scheme": [(b"authorization", f"Basic {TOKEN}".encode())],
    "as x-api-key": [(b"x-api-key", TOKEN.encode())],
    "non-ASCII": [(b"authorization", f"Bearer {TOKEN[:-1]}é".encode())],
}


def served_routes(app: GatewayApp) -> list[tuple[str, str]]:
    """(method, path template) of every route the app serves."""
    from starlette.routing import Route

    out = [("POST", path) for path in proxy_paths()]
    for route in app.router.routes:
        assert isinstance(route, Route), f"{route!r} is not a plain Route: teach served_routes about it"
        out += [(method, route.path) for method in sorted(route.methods or ())]
    return out


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'sec.db'}")
    yield s
    s.close()


@contextlib.asynccontextmanager
async def serving(gw: Gateway, client: tuple[str, int] = LOOPBACK) -> AsyncIterator[httpx.AsyncClient]:
    await gw.startup()
    try:
        transport = httpx.ASGITransport(app=gw.app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test", timeout=30) as c:
            yield c
    finally:
        await gw.shutdown()


async def send(c: httpx.AsyncClient, method: str, template: str, rid: str,
               headers: list[tuple[bytes, bytes]], body: dict | None = None, other: str = "r0") -> httpx.Response:
    path = template.replace("{rid}", rid)
    names = {"{rid}": rid, "{other}": other}  # a body naming rollouts (the review page's compare)
    body = {k: names.get(v, v) if isinstance(v, str) else v for k, v in (body or {}).items()}
    return await c.request(method, path, headers=headers, json=body if method == "POST" else None)


async def new_rollout(c: httpx.AsyncClient, headers: list[tuple[bytes, bytes]] = AUTH) -> str:
    r = await c.post("/rollouts", json={"task_id": "t"}, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def assert_every_route_served(gw: Gateway, c: httpx.AsyncClient, headers: list[tuple[bytes, bytes]]) -> None:
    """Each route, on a fresh rollout where it takes one, answers 2xx to `headers`."""
    other = await new_rollout(c, headers)
    for method, template in served_routes(gw.app):
        r = await send(c, method, template, await new_rollout(c, headers), headers, BODIES.get(template, {}), other)
        assert 200 <= r.status_code < 300, (method, template, r.status_code, r.text)
        if gw.gate.paused:  # /admin/pause leaves it paused; the next route needs it serving
            await gw.aresume()


def test_the_walk_sees_every_kind_of_route(sqlite_store: TraceStore) -> None:
    routes = served_routes(Gateway(["http://127.0.0.1:1/v1"], sqlite_store).app)
    assert len(routes) == len(set(routes)) and PUBLIC | WRITES <= set(routes)
    for _method, template in routes:  # the raw handler takes exactly the proxy paths, nothing the router has
        assert (proxy_route(template.replace("{rid}", "r1")) is not None) == (template in proxy_paths()), template


async def test_every_route_but_health_needs_the_token(llm_server: LLMTestServer, sqlite_store: TraceStore) -> None:
    gw = Gateway([llm_server.base_url], sqlite_store, token=TOKEN, health_interval_s=0, policy_version=1)
    async with serving(gw, OFF_LOOPBACK) as c:  # a token makes the gateway usable off loopback
        target = await new_rollout(c)
        answered_without_token = set()
        for method, template in served_routes(gw.app):
            for why, headers in WRONG_AUTH.items():
                r = await send(c, method, template, target, headers, BODIES.get(template, {}))
                if r.status_code != 401:
                    answered_without_token.add((method, template))
                    assert r.status_code == 200, (method, template, why, r.status_code)
                    continue
                assert r.headers["www-authenticate"] == "Bearer", (method, template, why)
                if method != "HEAD":
                    assert r.json()["error"]["type"] == "authentication_error"
        assert answered_without_token == PUBLIC
        # Nothing any of those requests named was written, paused or versioned.
        gw.store.flush()
        stored = gw.store.get_rollout(target)
        assert stored is not None and stored.status == "running" and stored.final_reward is None
        assert gw.store.rewards(target) == [] and gw.store.calls(target) == []
        with gw.store.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM rollouts")).scalar() == 1
            assert conn.execute(sa.text("SELECT count(*) FROM llm_calls")).scalar() == 0
        assert not gw.gate.paused and gw.policy_version == 1
        await assert_every_route_served(gw, c, AUTH)
        assert gw.policy_version == 3  # /admin/resume was really served


async def test_without_a_token_only_loopback_clients_are_served(llm_server: LLMTestServer,
                                                                sqlite_store: TraceStore) -> None:
    # `build_app` served by another server on another address: the loopback rule still holds.
    gw = Gateway([llm_server.base_url], sqlite_store, health_interval_s=0)
    async with serving(gw, OFF_LOOPBACK) as c:
        refused = set()
        for method, template in served_routes(gw.app):
            r = await send(c, method, template, "r1", [], BODIES.get(template, {}))
            if r.status_code == 403:
                refused.add((method, template))
        assert refused == set(served_routes(gw.app)) - PUBLIC
    for client in (LOOPBACK, ("::1", 50000), ("::ffff:127.0.0.1", 50000)):
        async with serving(gw, client) as c:
            await assert_every_route_served(gw, c, [])


async def test_a_rollout_id_is_not_enough_to_write_into_another_runs_rollout(
        llm_server: LLMTestServer, sqlite_store: TraceStore) -> None:
    gw = Gateway([llm_server.base_url], sqlite_store, token=TOKEN, health_interval_s=0)
    async with serving(gw) as c:
        rid = await new_rollout(c)
        assert (await c.post(f"/rollouts/{rid}/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
        for headers in WRONG_AUTH.values():  # someone who knows the id, not the token
            tries = [c.post(f"/rollouts/{rid}/reward", json={"value": 9.0}, headers=headers),
                     c.post(f"/rollouts/{rid}/finish", json={"reward": 9.0}, headers=headers),
                     c.post(f"/rollouts/{rid}/fail", json={"error": "x"}, headers=headers),
                     c.post("/rollouts", json={"id": rid, "task_id": "t"}, headers=headers),
                     c.get(f"/rollouts/{rid}", headers=headers),
                     c.post(f"/rollouts/{rid}/v1/chat/completions", json=CHAT, headers=headers),
                     c.post("/v1/chat/completions", json=CHAT, headers=[*headers, (b"x-rollout-id", rid.encode())])]
            assert [(await t).status_code for t in tries] == [401] * len(tries)
        gw.store.flush()
        assert gw.store.rewards(rid) == [] and len(gw.store.calls(rid)) == 1
        assert gw.store.get_rollout(rid).status == "running"
        # Its own run, with the token, still rewards and finishes it.
        assert (await c.post(f"/rollouts/{rid}/reward", json={"value": 0.25}, headers=AUTH)).status_code == 200
        assert (await c.post(f"/rollouts/{rid}/finish", json={}, headers=AUTH)).status_code == 200
    done = sqlite_store.get_rollout(rid)
    assert done.status == "succeeded" and done.final_reward == 0.25


# What a rollout-scoped token opens: its own rollout's LLM calls, reading it, and its reward.
SCOPED = {("POST", path) for path in proxy_paths() if path.startswith("/rollouts/{rid}/")} | {
    ("GET", "/rollouts/{rid}"), ("HEAD", "/rollouts/{rid}"), ("POST", "/rollouts/{rid}/reward"),
    ("GET", "/rollouts/{rid}/v1/models"), ("HEAD", "/rollouts/{rid}/v1/models")}


async def test_a_rollout_token_opens_only_its_own_rollouts_routes(llm_server: LLMTestServer,
                                                                    sqlite_store: TraceStore) -> None:
    """Walked over every route: a rollout's token is served on `SCOPED` for its own rollout, and
    refused (403 rollout_scope) everywhere else: another rollout's routes, creating, finishing,
    admin, review, the unscoped proxy routes. Each refusal is its rollout's breach, recorded once
    per class; a token for another gateway's token, or cut, is a plain 401."""
    gw = Gateway([llm_server.base_url], sqlite_store, token=TOKEN, health_interval_s=0, policy_version=1)
    async with serving(gw, OFF_LOOPBACK) as c:
        mine, other = await new_rollout(c), await new_rollout(c)
        scoped = [(b"authorization", f"Bearer {rollout_token(TOKEN, mine)}".encode())]
        served, refused = set(), set()
        for method, template in served_routes(gw.app):
            for target in (mine, other):
                r = await send(c, method, template, target, scoped, BODIES.get(template, {}), other)
                if (method, template) in PUBLIC:
                    continue
                if 200 <= r.status_code < 300:
                    served.add((method, template, target))
                else:
                    assert r.status_code == 403, (method, template, r.status_code, r.text)
                    if method != "HEAD":
                        assert "token opens only its own routes" in r.text, (method, template, r.text)
                    refused.add((method, template, target))
        assert served == {(m, t, mine) for m, t in SCOPED}
        assert len(refused) == 2 * (len(served_routes(gw.app)) - len(PUBLIC)) - len(SCOPED)
        gw.store.flush()
        assert sqlite_store.get_rollout(other).status == "running" and not sqlite_store.calls(other)
        assert sqlite_store.get_rollout(mine).status == "running" and sqlite_store.calls(mine)
        assert not gw.gate.paused and gw.policy_version == 1
        breaches = sqlite_store.events(kind=SANDBOX_BREACH)
        assert [(e.data["rollout_id"], e.data["class"], e.source) for e in breaches] == [
            (mine, "sandbox_network", "gateway")]
        for bad in (rollout_token("another-gateway-token", mine), rollout_token(TOKEN, mine)[:-1] + "x",
                    rollout_token(TOKEN, mine)[:40], "lmr1." + "0" * 64 + "." + mine):
            r = await c.get(f"/rollouts/{mine}", headers={"authorization": f"Bearer {bad}"})
            assert r.status_code == 401, bad


async def test_a_rollout_token_cannot_send_a_refused_reward(llm_server: LLMTestServer,
                                                           sqlite_store: TraceStore) -> None:
    """With `agent_reward = false`, a reward from a rollout's own token is refused and is its
    `sandbox_reward` breach; the gateway's token is refused too, but is no rollout's breach."""
    from lightning_middleware import RewardConfig

    config = RewardConfig.from_dict({"rules": {"n": {"function": "lightning_middleware.rewards.rules:succeeded",
                                                     "weight": 1.0}}, "agent_reward": False})
    gw = Gateway([llm_server.base_url], sqlite_store, token=TOKEN, health_interval_s=0, rewards=config)
    async with serving(gw) as c:
        rid, other = await new_rollout(c), await new_rollout(c)
        own = {"authorization": f"Bearer {rollout_token(TOKEN, rid)}"}
        r = await c.post(f"/rollouts/{rid}/reward", json={"value": 1.0}, headers=own)
        assert r.status_code == 403 and r.json()["error"]["code"] == "reward_refused"
        r = await c.post(f"/rollouts/{other}/reward", json={"value": 1.0}, headers=AUTH)
        assert r.status_code == 403 and r.json()["error"]["code"] == "reward_refused"
        assert (await c.post(f"/rollouts/{rid}/finish", json={}, headers=own)).status_code == 403
    assert [(e.data["rollout_id"], e.data["class"]) for e in sqlite_store.events(kind=SANDBOX_BREACH)] == [
        (rid, "sandbox_reward"), (rid, "sandbox_network")]
    assert sqlite_store.rewards(rid) == [] and sqlite_store.rewards(other) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.20", "example.com",
                                  "127.0.0.1.nip.io"])
def test_off_loopback_needs_a_token(sqlite_store: TraceStore, host: str) -> None:
    for no_token in (None, ""):
        with pytest.raises(GatewayConfigError, match=f"refusing to listen on {host} without a bearer token"):
            Gateway(["http://127.0.0.1:1/v1"], sqlite_store, host=host, token=no_token)
    assert Gateway(["http://127.0.0.1:1/v1"], sqlite_store, host=host, token=TOKEN).token == TOKEN


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]", "::ffff:127.0.0.1"])
def test_loopback_needs_no_token(sqlite_store: TraceStore, host: str) -> None:
    assert Gateway(["http://127.0.0.1:1/v1"], sqlite_store, host=host).token is None


@pytest.mark.parametrize("token", [" ", "two words", "tab\there", "tök", "new\nline"])
def test_a_token_that_cannot_travel_in_a_header_is_refused(sqlite_store: TraceStore, token: str) -> None:
    with pytest.raises(GatewayConfigError, match="visible ASCII"):
        Gateway(["http://127.0.0.1:1/v1"], sqlite_store, token=token)


def test_bearer_check_accepts_only_the_token() -> None:
    for ok in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN} "):
        check_bearer(TOKEN, ok)
    for bad in ("", "Bearer", "Bearer ", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Bearer x{TOKEN}",
                f"Bearer {TOKEN.upper()}", TOKEN, f"Token {TOKEN}", f"Bearer {TOKEN[:-1]}é", "Bearer \x00"):
        with pytest.raises(HTTPError) as err:
            check_bearer(TOKEN, bad)
        assert err.value.status == 401
    check_bearer(None, "")  # no token: open (loopback only, `check_client`)
    check_bearer(None, "Bearer anything")
    # Any two strings compare, of any length and alphabet, without the TypeError compare_digest
    # raises on non-ASCII str.
    assert tokens_match("tök-ünï", "tök-ünï") and not tokens_match("tök", "tok") and not tokens_match("", "a")
    assert not tokens_match("a" * 10_000, "a")


# --------------------------------------------------------------------------
# Credentials never reach the store
# --------------------------------------------------------------------------

KEYS = {"client": "sk-client-4f1a9b2c7d", "header": "sk-xheader-8e3d5a1b", "body": "sk-bodykey-2c9f7e4a",
        "nested": "sk-nested-6b1d3f8e", "upstream": "sk-upstream-9a7c5e3b"}


def stored_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.iterdir()) if p.is_file())


def assert_no_credentials(root: Path, *extra: str) -> None:
    data = stored_bytes(root)
    assert b"what is 2+2?" in data  # the store holds the call: the next checks look at real data
    for secret in [*KEYS.values(), *extra]:
        assert secret.encode() not in data, secret
    assert b"Bearer" not in data and b"x-api-key" not in data.lower()
    assert scan_tree(root) == []


def test_credentials_never_reach_the_store_through_wrap(tmp_path: Path) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'wrap.db'}")
    client = wrap(openai.OpenAI(base_url=TEST_BASE_URL, api_key=KEYS["client"], http_client=llm_http_client(httpx2)),
                  store=store)
    with rollout("t", store=store) as r:
        client.chat.completions.create(
            model="m", messages=CHAT["messages"], extra_headers={"x-api-key": KEYS["header"]},
            extra_body={"api_key": KEYS["body"], "extra_headers": {"Authorization": f"Bearer {KEYS['nested']}"}})
        client.chat.completions.create(model="m", messages=CHAT["messages"],
                                       extra_headers={"Authorization": f"Bearer {KEYS['upstream']}"})
    assert len(store.calls(r.id)) == 2
    store.close()
    assert_no_credentials(tmp_path)


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_credentials_never_reach_the_store_through_the_gateway(llm_server: LLMTestServer, tmp_path: Path,
                                                                     token: str | None) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'gw.db'}")
    gw = Gateway([llm_server.base_url], store, token=token, health_interval_s=0,
                 upstream_api_key=KEYS["upstream"] if token else None)
    auth = [(b"authorization", f"Bearer {token or KEYS['client']}".encode())]
    body = {**CHAT, "api_key": KEYS["body"], "extra_headers": {"Authorization": f"Bearer {KEYS['nested']}"}}
    async with serving(gw) as c:
        rid = await new_rollout(c, auth)
        for path in (f"/rollouts/{rid}/v1/chat/completions", "/v1/chat/completions"):
            r = await c.post(path, json=body, headers=[*auth, (b"x-api-key", KEYS["header"].encode())])
            assert r.status_code == 200, r.text
        assert (await c.post(f"/rollouts/{rid}/finish", json={}, headers=auth)).status_code == 200
    assert len(store.calls(rid)) == 1 and len(store.calls(None)) == 1
    store.close()
    assert_no_credentials(tmp_path, TOKEN)
