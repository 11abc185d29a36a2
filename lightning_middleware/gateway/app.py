"""The gateway's ASGI app: the two proxy routes served raw (every LLM call takes them), the
rollout, admin, health, models and labelling-page (/review) routes by a Starlette router."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from lightning_middleware.asgi.error_replies import HTTPError, error_reply
from lightning_middleware.asgi.replies import Receive, Scope, Send
from lightning_middleware.gateway.requests import check_headers, parse_object, proxy_route, receive_body
from lightning_middleware.gateway.reward_keys import IDEMPOTENCY_HEADER
from lightning_middleware.gateway.rollout_policies import policies_from_metadata
from lightning_middleware.gateway.rollouts import REWARD_REFUSED, check_rollout_id
from lightning_middleware.records import Rollout, RolloutStatus

if TYPE_CHECKING:  # the gateway builds its app: a type-only import keeps the arrow one-way
    from starlette.applications import Starlette

    from lightning_middleware.gateway.service import Gateway


MAX_WAIT_S = 86_400  # the longest a pause may wait to drain (asyncio's timers overflow on absurd ones)
MAX_INT32 = 2**31 - 1


class GatewayApp:
    """The gateway's ASGI app. The two proxy routes, which every LLM call takes, are served
    straight from here; the rest (rollouts, admin, health, models) by a Starlette router."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.router = build_routes(gateway)  # every route but the proxy ones (`requests.proxy_paths()`)
        self.state = self.router.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Only `proxy_route` paths are served here: the security tests walk `proxy_paths()` and
        # `router.routes` and check each route's token rule, so a new route belongs in one of them.
        if scope["type"] == "http":
            try:
                check_headers(scope["headers"], self.gateway.max_header_bytes)
            except HTTPError as exc:
                await exc.reply()(scope, receive, send)
                return
            route = proxy_route(scope["path"])
            if route is not None:
                if scope["method"] == "POST":
                    await self.gateway.serve_proxy(scope, receive, send, *route)
                else:
                    await HTTPError(405, f"method {scope['method']} not allowed on {scope['path']}",
                                     code="method_not_allowed").reply()(scope, receive, send)
                return
        await self.router(scope, receive, send)


def _review_routes(gw: Gateway) -> list[Any]:
    """The labelling page at /review (it holds no data, like /health) and its API under
    /review/api, behind the gateway's token rule; labels combine under the gateway's rewards."""
    from lightning_middleware.rewards.review import Labelling, review_routes

    def check(request: Any) -> None:
        gw.check_auth(request.headers.get("authorization", ""), request.scope.get("client"))

    return review_routes(Labelling(gw.store, gw.rollouts.scorer), check, prefix="/review")


def build_routes(gw: Gateway) -> Starlette:
    """The Starlette app for everything but the proxy routes: rollouts, admin, health, models."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def endpoint(fn: Any, *, auth: bool = True, scoped: bool = False) -> Any:
        """`scoped`: a route of one rollout that its rollout-scoped token may use (asgi/auth.py)."""
        async def handler(request: Request) -> Any:
            try:
                if auth:
                    request.state.scoped = gw.check_auth(
                        request.headers.get("authorization", ""), request.scope.get("client"),
                        rollout_id=request.path_params.get("rid") if scoped else None,
                        route=f"{request.method} {request.url.path}")
                return await fn(request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
                return error_reply(exc, request.method, request.url.path)
        return handler

    async def json_body(request: Request, *, optional: bool = False) -> dict[str, Any]:
        raw = await receive_body(request.receive, request.headers, gw.max_body_bytes)
        if not raw.strip() and optional:
            return {}
        return parse_object(raw)

    def rollout_json(r: Rollout, request: Request) -> dict[str, Any]:
        d = {k: v for k, v in r.__dict__.items()}
        d.update(policies_from_metadata(r.metadata).as_json())  # the rollout's own map, if any
        d["base_url"] = str(request.base_url).rstrip("/") + f"/rollouts/{r.id}/v1"
        return d

    async def models(request: Request) -> Any:
        rid = request.path_params.get("rid")
        if rid:
            await gw.rollouts.entry(rid, for_call=False)
        return await gw.forwarder.get("models")

    async def create(request: Request) -> Any:
        stored, created = await gw.rollouts.create(await json_body(request), gw.policy_version)
        return JSONResponse({**rollout_json(stored, request), "created": created}, status_code=201 if created else 200)

    async def get_rollout(request: Request) -> Any:
        rid = request.path_params["rid"]
        check_rollout_id(rid)  # an id no rollout can have is never looked up (PostgreSQL refuses a NUL)
        stored = await asyncio.to_thread(gw.store.get_rollout, rid)
        if stored is None:
            raise HTTPError(404, f"no rollout {rid!r}", code="rollout_not_found")
        return JSONResponse({**rollout_json(stored, request), "in_flight": gw.rollouts.in_flight(rid)})

    async def reward(request: Request) -> Any:
        rid = request.path_params["rid"]
        try:
            return await gw.reward_keys.post(rid, await json_body(request), request.headers.get(IDEMPOTENCY_HEADER))
        except HTTPError as exc:  # a confined rollout that sends its own reward where the configuration refuses it
            if exc.code == REWARD_REFUSED and request.state.scoped:
                gw.record_breach(rid, "sandbox_reward", "POST /reward refused by the reward configuration")
            raise

    async def finish(request: Request) -> Any:
        done = await gw.rollouts.finish(request.path_params["rid"], await json_body(request, optional=True),
                                       default_status=RolloutStatus.SUCCEEDED.value)
        return JSONResponse(rollout_json(done, request))

    async def fail(request: Request) -> Any:
        done = await gw.rollouts.finish(request.path_params["rid"], await json_body(request, optional=True),
                                       default_status=RolloutStatus.FAILED.value)
        return JSONResponse(rollout_json(done, request))

    async def pause(request: Request) -> Any:
        body = await json_body(request, optional=True)
        timeout = body.get("timeout", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_WAIT_S:
            raise HTTPError(400, f"timeout must be a number of seconds from 0 to {MAX_WAIT_S}")
        return JSONResponse(await gw.apause(wait=bool(body.get("wait", True)), timeout=float(timeout),
                                            mode=body.get("mode")))

    async def resume(request: Request) -> Any:
        body = await json_body(request, optional=True)
        pv = body.get("policy_version")
        if pv is not None and (isinstance(pv, bool) or not isinstance(pv, int) or not 0 <= pv <= MAX_INT32):
            raise HTTPError(400, f"policy_version must be an integer from 0 to {MAX_INT32}")  # the store's column
        return JSONResponse(await gw.aresume(policy_version=pv))

    async def state(_request: Request) -> Any:
        return JSONResponse(gw.snapshot())

    async def health(_request: Request) -> Any:
        return JSONResponse({"ok": True, "paused": gw.gate.paused,
                             "healthy_upstreams": sum(u.healthy for u in gw.upstreams)})

    async def not_found(request: Request, _exc: Exception) -> Any:
        err = HTTPError(404, f"no route {request.method} {request.url.path}", code="not_found")
        return err.reply()

    async def bad_method(request: Request, _exc: Exception) -> Any:
        err = HTTPError(405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        return err.reply()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    routes = [
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/rollouts", endpoint(create), methods=["POST"]),
        Route("/rollouts/{rid}", endpoint(get_rollout, scoped=True), methods=["GET"]),
        Route("/rollouts/{rid}/reward", endpoint(reward, scoped=True), methods=["POST"]),
        Route("/rollouts/{rid}/finish", endpoint(finish), methods=["POST"]),
        Route("/rollouts/{rid}/fail", endpoint(fail), methods=["POST"]),
        Route("/rollouts/{rid}/v1/models", endpoint(models, scoped=True), methods=["GET"]),
        Route("/admin/pause", endpoint(pause), methods=["POST"]),
        Route("/admin/resume", endpoint(resume), methods=["POST"]),
        Route("/admin/state", endpoint(state), methods=["GET"]),
        *_review_routes(gw),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.router.redirect_slashes = False  # "/rollouts/" is a JSON 404, not a redirect to another route
    app.state.gateway = gw
    return app
