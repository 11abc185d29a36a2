"""The labelling page's app: a person scores one rollout, or compares two of the same task, and
each label is stored as a reward named "human" (docs/rewards.md, "Human feedback").

    lightning-mw rewards label --store URL [--config rewards.toml] [--port 8095]

Routes: `GET /` (the page), `GET /api/next` (the next rollout to score), `GET /api/pair` (two
rollouts of one task to compare), `GET /api/rollouts/{id}`, `POST /api/rollouts/{id}/score`
`{"score": 0..1, "labeler", "note", "label_id"}`, `POST /api/compare` `{"a", "b",
"winner": "a" | "b" | "tie", "labeler", "note", "label_id"}`, `GET /api/stats`. A `label_id`
(the page sends one per rollout or pair shown) makes a double click or a retried POST store its
label once: the repeat is answered `{"stored": 0, "replayed": true}`; the same id with another
label is a 409. Checked and stored under one lock, so two concurrent repeats store one label; the
id is kept with the label, so it also holds after a restart. With a configuration, the
rollouts its human `interval` picks come first, and each label combines the rollout's final
reward again (`Scorer.score_rollout`, the reward model not asked again). Without a token only
loopback clients are served; with one, the API needs `Authorization: Bearer <token>` (the page
reads it from its address: `http://host:port/#token=...`). The gateway serves the same routes
under `/review` (its reward configuration, its token: `http://gateway/review#token=...`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_middleware.asgi.auth import check_bearer, check_client
from lightning_middleware.asgi.error_replies import HTTPError, error_reply
from lightning_middleware.records import Reward, Rollout
from lightning_middleware.rewards.combine import Scorer
from lightning_middleware.rewards.page import PAGE
from lightning_middleware.rewards.rescore import ENDED, calibration
from lightning_middleware.rewards.sources import wants_label
from lightning_middleware.rewards.trajectory import HUMAN, Trajectory, load_trajectory
from lightning_middleware.store import TraceStore

if TYPE_CHECKING:
    from starlette.applications import Starlette

MAX_NOTE = 2000
WINNERS = {"a": (1.0, 0.0), "b": (0.0, 1.0), "tie": (0.5, 0.5)}
_NOT_COMPONENTS = ("final", "reward_errors", "reward_pending", HUMAN)
LABEL_ID = "label_id"  # the metadata field a label's label_id is kept in


def _view(t: Trajectory, scorer: Scorer | None) -> dict[str, Any]:
    """What the page shows of a rollout."""
    r = t.rollout
    components = {}
    if scorer is not None:
        for reward in t.rewards:
            if reward.config_hash == scorer.hash and reward.name not in _NOT_COMPONENTS:
                components[str(reward.name)] = reward.value
    return {
        "id": r.id, "task_id": r.task_id, "status": str(r.status), "input": r.input,
        "final_reward": r.final_reward, "final_output": t.final_output,
        "messages": [_message(m) for m in t.messages], "components": components,
        "labels": [{"value": x.value, **{k: x.metadata.get(k) for k in ("kind", "labeler", "note")}}
                   for x in t.human_labels],
    }


def _message(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content", m.get("output"))
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    calls = [f"{(tc.get('function') or {}).get('name')}({(tc.get('function') or {}).get('arguments')})"
             for tc in m.get("tool_calls") or [] if isinstance(tc, dict)]
    return {"role": str(m.get("role", m.get("type", "?"))), "content": "" if content is None else str(content),
            "tool_calls": calls}


def _label_id(body: dict[str, Any]) -> str | None:
    value = body.get(LABEL_ID)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > 128:
        raise HTTPError(400, f"label_id must be 1 to 128 characters, got {value!r}", code="bad_label_id")
    return value


def _with_id(label: Reward, label_id: str | None) -> Reward:
    return label if label_id is None else dataclasses.replace(label, metadata={**label.metadata, LABEL_ID: label_id})


def _text(body: dict[str, Any], key: str, limit: int) -> str | None:
    value = body.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise HTTPError(400, f"{key} must be a string of at most {limit} characters", code=f"bad_{key}")
    return value


class Labelling:
    """The store side of the page: what to show next, and storing a label."""

    def __init__(self, store: TraceStore, scorer: Scorer | None = None) -> None:
        self.store = store
        self.scorer = scorer
        self._storing = threading.Lock()  # a label_id's check and its store, as one

    @property
    def interval(self) -> int:
        human = self.scorer.config.human if self.scorer is not None else None
        return human.interval if human is not None else 0

    def _labelled(self, rollouts: Sequence[Rollout]) -> set[str]:
        rewards = self.store.rewards_for([r.id for r in rollouts])
        return {rid for rid, rs in rewards.items() if any(x.name == HUMAN and x.config_hash is None for x in rs)}

    def _unlabelled(self, skip: set[str]) -> list[Rollout]:
        pool = [r for r in self.store.query_rollouts(status=ENDED, newest_first=True, limit=2000) if r.id not in skip]
        done = self._labelled(pool)
        todo = [r for r in pool if r.id not in done]
        return sorted(todo, key=lambda r: not wants_label(r.id, self.interval))  # stable: newest first within

    def next(self, skip: set[str]) -> dict[str, Any] | None:
        todo = self._unlabelled(skip)
        return self.view(todo[0].id) if todo else None

    def pair(self, skip: set[str]) -> list[dict[str, Any]] | None:
        groups: dict[str, list[Rollout]] = {}
        for r in self._unlabelled(skip):
            groups.setdefault(r.task_id, []).append(r)
        for members in groups.values():
            if len(members) >= 2:
                return [self.view(members[0].id), self.view(members[1].id)]
        return None

    def view(self, rollout_id: str) -> dict[str, Any]:
        try:
            return _view(load_trajectory(self.store, rollout_id), self.scorer)
        except KeyError:
            raise HTTPError(404, f"no rollout {rollout_id!r}", code="rollout_not_found") from None

    def _rollout(self, body: dict[str, Any], key: str) -> Rollout:
        rid = body.get(key)
        found = self.store.get_rollout(rid) if isinstance(rid, str) and rid else None
        if found is None:
            raise HTTPError(404 if isinstance(rid, str) and rid else 400, f"{key}: no rollout {rid!r}",
                            code="rollout_not_found")
        return found

    def _store(self, labels: list[Reward], label_id: str | None) -> dict[str, Any]:
        with self._storing:
            if label_id is not None and self._stored_before(labels, label_id):
                return {"stored": 0, "replayed": True, "final_rewards": {}}
            self.store.add_rewards([_with_id(r, label_id) for r in labels])
        finals = {}
        for label in labels:
            final = None
            if self.scorer is not None:
                final = self.scorer.score_rollout(self.store, label.rollout_id, reuse_model=True).scored.final
            finals[label.rollout_id] = final
        return {"stored": len(labels), "final_rewards": finals}

    def _stored_before(self, labels: list[Reward], label_id: str) -> bool:
        """Whether `label_id` stored these labels already (a 409 if it stored others)."""
        first = labels[0]
        stored = self.store.rewards_for([first.rollout_id]).get(first.rollout_id, [])
        earlier = [r for r in stored if r.name == HUMAN and r.metadata.get(LABEL_ID) == label_id]
        if not earlier:
            return False
        if earlier[0].value != first.value or earlier[0].metadata.get("kind") != first.metadata.get("kind"):
            raise HTTPError(409, f"label_id {label_id!r} already stored another label", code="label_id_conflict")
        return True

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        rollout = self._rollout(body, "rollout_id")
        value = body.get("score")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
                0.0 <= value <= 1.0):
            raise HTTPError(400, f"score must be a number from 0 to 1, got {value!r}", code="bad_score")
        meta = {"kind": "score", "labeler": _text(body, "labeler", 128), "note": _text(body, "note", MAX_NOTE)}
        return self._store([Reward(rollout.id, float(value), name=HUMAN, final=False, created_at=time.time(),
                                   metadata={k: v for k, v in meta.items() if v is not None})], _label_id(body))

    def compare(self, body: dict[str, Any]) -> dict[str, Any]:
        a, b = self._rollout(body, "a"), self._rollout(body, "b")
        if a.id == b.id:
            raise HTTPError(400, "a and b must be two different rollouts", code="bad_pair")
        winner = body.get("winner")
        if winner not in WINNERS:
            raise HTTPError(400, f"winner must be 'a', 'b' or 'tie', got {winner!r}", code="bad_winner")
        pair, now = uuid.uuid4().hex[:12], time.time()
        meta = {"kind": "compare", "pair": pair, "labeler": _text(body, "labeler", 128),
                "note": _text(body, "note", MAX_NOTE)}
        meta = {k: v for k, v in meta.items() if v is not None}
        va, vb = WINNERS[winner]
        return self._store([Reward(a.id, va, name=HUMAN, final=False, created_at=now, metadata={**meta, "vs": b.id}),
                            Reward(b.id, vb, name=HUMAN, final=False, created_at=now, metadata={**meta, "vs": a.id})],
                           _label_id(body))

    def stats(self) -> dict[str, Any]:
        ended = self.store.query_rollouts(status=ENDED)
        labelled = self._labelled(ended)
        queued = [r for r in ended if wants_label(r.id, self.interval)]
        return {"rollouts": len(ended), "labelled": len(labelled), "queued": len(queued),
                "queued_left": sum(r.id not in labelled for r in queued), "interval": self.interval,
                "config_hash": self.scorer.hash if self.scorer is not None else None,
                "agreement": self._agreement()}

    def _agreement(self) -> dict[str, Any] | None:
        """The reward model against the labels so far (None below 2 rollouts with both)."""
        try:
            cal = calibration(self.store, config_hash=self.scorer.hash if self.scorer is not None else None)
        except ValueError:
            return None
        return {"n": cal.n, "rank_correlation": cal.rank_correlation, "correlation": cal.correlation,
                "bias": cal.bias}


def review_routes(labels: Labelling, check: Callable[[Any], None], prefix: str = "") -> list[Any]:
    """The page (at `prefix`, or "/") and its API (under `prefix`/api) as Starlette routes;
    `check(request)` raises `HTTPError` for a request the API must refuse (the token rule)."""
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    def api(fn: Any) -> Any:
        async def handler(request: Request) -> Any:
            try:
                check(request)
                return JSONResponse(await fn(request))
            except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
                return error_reply(exc, request.method, request.url.path)
        return handler

    async def body(request: Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            raise HTTPError(400, "the body must be a JSON object", code="invalid_json") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the body must be a JSON object", code="invalid_json")
        return data

    def skip(request: Request) -> set[str]:
        return {s for s in request.query_params.get("skip", "").split(",") if s}

    async def page(_request: Request) -> Any:
        return HTMLResponse(PAGE)  # no data in it: the API it calls checks the token

    async def next_one(request: Request) -> Any:
        return {"rollout": await asyncio.to_thread(labels.next, skip(request))}

    async def pair(request: Request) -> Any:
        return {"pair": await asyncio.to_thread(labels.pair, skip(request))}

    async def one(request: Request) -> Any:
        return {"rollout": await asyncio.to_thread(labels.view, request.path_params["rid"])}

    async def score(request: Request) -> Any:
        return await asyncio.to_thread(labels.score, {**await body(request), "rollout_id": request.path_params["rid"]})

    async def compare(request: Request) -> Any:
        return await asyncio.to_thread(labels.compare, await body(request))

    async def stats(_request: Request) -> Any:
        return await asyncio.to_thread(labels.stats)

    return [
        Route(prefix or "/", page, methods=["GET"]),
        Route(f"{prefix}/api/next", api(next_one), methods=["GET"]),
        Route(f"{prefix}/api/pair", api(pair), methods=["GET"]),
        Route(f"{prefix}/api/rollouts/{{rid}}", api(one), methods=["GET"]),
        Route(f"{prefix}/api/rollouts/{{rid}}/score", api(score), methods=["POST"]),
        Route(f"{prefix}/api/compare", api(compare), methods=["POST"]),
        Route(f"{prefix}/api/stats", api(stats), methods=["GET"]),
    ]


def build_app(store: TraceStore, *, scorer: Scorer | None = None, token: str | None = None) -> Starlette:
    """The labelling page and its API as a Starlette app of its own (`lightning-mw rewards
    label`; the gateway serves the same routes under /review)."""
    from starlette.applications import Starlette

    def check(request: Any) -> None:
        check_client(token, request.scope.get("client"))
        check_bearer(token, request.headers.get("authorization", ""))

    return Starlette(routes=review_routes(Labelling(store, scorer), check))
