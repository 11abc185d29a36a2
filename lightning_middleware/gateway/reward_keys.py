"""A retried reward POST stores its reward once.

A client whose `POST /rollouts/{id}/reward` timed out cannot tell whether the reward was stored:
it retries, and without a key the retry stores the reward a second time. With an
`Idempotency-Key` header (the common HTTP convention) the gateway stores the first request's
reward and answers every retry of that key, in that rollout, with the first answer (header
`x-lightning-replayed: 1`); the same key with another body is a 409.

Where the keys live: the key is stored with its reward (the reward's metadata field `idempotency_key`),
so a retry is recognised after a gateway restart, by another gateway on the same store, and for
as long as the reward is kept. A bounded in-memory cache (a `ReplayCache` of its own, so LLM
answers never evict reward keys) answers recent retries with the first answer's exact bytes and
makes a retry that arrives while the first request is still running wait for it instead of
racing it. An answer rebuilt from the store (after a restart or past the cache) carries the stored
reward's fields and `"applied": false`: the retry itself moved nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from lightning_middleware import fastjson
from lightning_middleware.asgi.error_replies import HTTPError
from lightning_middleware.asgi.replies import JSON_HEADERS, Full
from lightning_middleware.gateway.replay import Cached, ReplayCache
from lightning_middleware.gateway.rollouts import REWARD_KEY_FIELD, RolloutRegistry, check_rollout_id
from lightning_middleware.records import Reward

IDEMPOTENCY_HEADER = "idempotency-key"
MAX_KEY_CHARS = 255
REPLAYED = (b"x-lightning-replayed", b"1")


def check_key(key: str) -> None:
    """An Idempotency-Key, on the reward route and on LLM calls: 1 to 255 visible characters (the
    store's column), else a 400 before anything is claimed or stored."""
    if not key.strip() or len(key) > MAX_KEY_CHARS:
        raise HTTPError(400, f"an Idempotency-Key is 1 to {MAX_KEY_CHARS} visible characters",
                        code="bad_idempotency_key", param="Idempotency-Key")


def reward_answer(reward: Reward, applied: bool) -> dict[str, Any]:
    """What `POST /rollouts/{id}/reward` answers for a stored reward."""
    return {"rollout_id": reward.rollout_id, "value": reward.value, "name": reward.name, "final": reward.final,
            "call_index": reward.call_index, "agent": reward.agent, "late": bool(reward.metadata.get("late")),
            "applied": applied}


def _what(reward: Reward) -> tuple[Any, ...]:
    """What makes two requests under one key the same reward (its metadata may differ)."""
    return reward.value, reward.name, reward.final, reward.call_index, reward.agent


def _digest(reward: Reward) -> str:
    return hashlib.sha256(json.dumps(_what(reward)).encode()).hexdigest()


class RewardKeys:
    """The reward route's idempotency: keys scoped per rollout, the newest `max_entries` answers
    kept in memory for `ttl_s`, every key kept in the store with its reward."""

    def __init__(self, registry: RolloutRegistry, *, max_entries: int = 4096, ttl_s: float = 3600.0) -> None:
        self.registry = registry
        self.cache = ReplayCache(retry_window_s=0.0, idempotency_ttl_s=ttl_s, max_entries=max_entries,
                                 max_wait_s=registry.finish_wait_s + 60)
        self.ttl_s = ttl_s

    async def post(self, rollout_id: str, body: dict[str, Any], key: str | None) -> Full:
        """Store the reward `body` describes, once per `key` (None: no key, stored every time)."""
        check_rollout_id(rollout_id)
        if key is None:
            reward, applied = await self.registry.add_reward(rollout_id, body)
            return _json(reward_answer(reward, applied))
        check_key(key)
        digest = _digest(self.registry.reward_for(rollout_id, body))  # a bad body is a 400 here, before any claim
        cache_key = ("reward", rollout_id, key)
        claimed = await self.cache.claim(cache_key, self.ttl_s, digest)
        if isinstance(claimed, Cached):
            return Full(claimed.status, [*claimed.headers, REPLAYED], claimed.body)
        result: Cached | None = None
        try:
            answer, replayed = await self._store_once(rollout_id, body, key)
            result = Cached(200, JSON_HEADERS, fastjson.dumps(answer).encode())
            return Full(200, [*JSON_HEADERS, REPLAYED] if replayed else JSON_HEADERS, result.body)
        finally:
            self.cache.land(cache_key, claimed, result)  # a failure is forgotten: its retry runs again

    async def _store_once(self, rollout_id: str, body: dict[str, Any], key: str) -> tuple[dict[str, Any], bool]:
        """(the answer, whether it was rebuilt from a reward the key had already stored)."""
        stored = await asyncio.to_thread(self.registry.store.rewards_for, [rollout_id])
        earlier = [r for r in stored.get(rollout_id, []) if r.metadata.get(REWARD_KEY_FIELD) == key]
        if not earlier:
            reward, applied = await self.registry.add_reward(rollout_id, body, key=key)
            return reward_answer(reward, applied), False
        first = earlier[0]
        asked = self.registry.reward_for(rollout_id, body)
        if _what(first) != _what(asked):
            raise HTTPError(409, "Idempotency-Key reused with a different reward", code="idempotency_conflict",
                            param="Idempotency-Key")
        return reward_answer(first, False), True


def _json(answer: dict[str, Any]) -> Full:
    return Full(200, JSON_HEADERS, fastjson.dumps(answer).encode())
