"""Rollouts opened over HTTP: created (idempotent on a client-supplied id), their calls counted,
rewarded, and finished once their calls in flight have landed in the store.

With a reward configuration (`Gateway(rewards=...)`) a rollout is scored as it finishes, before
it shows as finished; a reward sent after that is kept (marked `late`) and combined again.
Without one, a late final reward moves `final_reward` under the store's rule (reward_ops)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.asgi.error_replies import HTTPError
from lightning_middleware.capture import RolloutState
from lightning_middleware.gateway.requests import is_rollout_id, short_text
from lightning_middleware.gateway.rollout_policies import policies_from_body, policies_from_metadata, with_policies
from lightning_middleware.records import Event, Mode, Reward, Rollout, RolloutStatus
from lightning_middleware.rewards import Scorer
from lightning_middleware.rewards.config import AGENT
from lightning_middleware.store import TraceStore

log = logging.getLogger(__name__)
REWARD_REFUSED = "reward_refused"  # the event kind and the 403's code

REWARD_KEY_FIELD = "idempotency_key"  # the reward metadata field an Idempotency-Key is kept in


@dataclass
class RolloutEntry:
    """An open rollout: its capture state and the calls it has in flight."""

    state: RolloutState
    finished: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    reward_stored: bool = False  # a finish that failed after storing its reward: its retry does not store it again

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self.idle.set()


class RolloutRegistry:
    """The rollouts this gateway has open (finished ones are forgotten; the store keeps them)."""

    def __init__(self, store: TraceStore, *, finish_wait_s: float = 600.0, scorer: Scorer | None = None) -> None:
        self.store = store
        self.finish_wait_s = finish_wait_s
        self.scorer = scorer
        self._open: dict[str, RolloutEntry] = {}

    def open_count(self) -> int:
        return sum(not e.finished for e in self._open.values())

    def in_flight(self, rollout_id: str) -> int:
        entry = self._open.get(rollout_id)
        return entry.in_flight if entry is not None else 0

    async def entry(self, rollout_id: str, *, for_call: bool) -> RolloutEntry:
        """The open rollout a call or request names (loaded from the store after a restart)."""
        entry = self._open.get(rollout_id)
        if entry is None:
            check_rollout_id(rollout_id)
            stored = await asyncio.to_thread(self.store.get_rollout, rollout_id)
            if stored is None:
                raise HTTPError(404, f"no rollout {rollout_id!r}: create it first with POST /rollouts",
                                 code="rollout_not_found")
            entry = self._open.get(rollout_id)  # created meanwhile?
            if entry is None:
                state = RolloutState(stored.id, stored.task_id, stored.mode, self.store, stored.policy_version)
                policies_from_metadata(stored.metadata).apply(state)  # routed as before the restart
                if stored.status == RolloutStatus.RUNNING.value:
                    # Opened before a restart or by another gateway: continue its call numbering.
                    calls = await asyncio.to_thread(self.store.calls, rollout_id)
                    start = max((c.call_index for c in calls), default=-1) + 1
                    state.continue_from(start)
                entry = RolloutEntry(state, finished=stored.status != RolloutStatus.RUNNING.value)
                entry.idle.set()
                if not entry.finished:
                    self._open[rollout_id] = entry
        if for_call and entry.finished:
            raise HTTPError(409, f"rollout {rollout_id!r} is finished; it takes no more calls", code="rollout_finished")
        return entry

    async def create(self, body: dict[str, Any], policy_version: int | None) -> tuple[Rollout, bool]:
        task_id = body.get("task_id")
        if not short_text(task_id) or not task_id:
            raise HTTPError(400, "task_id (a non-empty string, at most 255 characters, no NUL) is required",
                            code="bad_task_id")
        rid = body.get("id") if body.get("id") is not None else body.get("rollout_id")
        if rid is None:
            rid = uuid.uuid4().hex
        check_rollout_id(rid)
        mode = body.get("mode", Mode.TRAIN.value)
        if mode not in (Mode.TRAIN.value, Mode.VAL.value):
            raise HTTPError(400, f"mode must be 'train' or 'val', got {mode!r}", code="bad_mode")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise HTTPError(400, "metadata must be an object", code="bad_metadata")
        policies = policies_from_body(body)
        rollout = Rollout(id=rid, task_id=task_id, mode=mode, input=body.get("input"),
                          metadata=with_policies(metadata, policies), policy_version=policy_version,
                          created_at=time.time())
        stored, created = await asyncio.to_thread(self.store.create_rollout, rollout)
        if not created and (stored.task_id != task_id or stored.mode != mode):
            raise HTTPError(409, f"rollout {rid!r} exists with task_id={stored.task_id!r} mode={stored.mode.value!r}",
                             code="rollout_conflict")
        if not created and policies_from_metadata(stored.metadata) != policies:
            raise HTTPError(409, f"rollout {rid!r} exists with another policy map: "
                            f"{policies_from_metadata(stored.metadata).as_json()}", code="rollout_conflict")
        if created:
            state = RolloutState(rid, task_id, mode, self.store, policy_version)
            policies.apply(state)
            entry = RolloutEntry(state)
            entry.idle.set()
            self._open[rid] = entry
        return stored, created

    async def add_reward(self, rollout_id: str, body: dict[str, Any], *, key: str | None = None) -> tuple[Reward, bool]:
        """Store a reward (after the finish too: kept as `late`); (the reward, whether it moved
        the rollout's final reward). `key`: the request's Idempotency-Key, stored with it (reward_keys)."""
        entry = await self.entry(rollout_id, for_call=False)
        await self.check_agent_reward(rollout_id, "POST /rollouts/{id}/reward")
        reward = reward_from(rollout_id, body, scorer=self.scorer, late=entry.finished)
        if key is not None:
            reward = dataclasses.replace(reward, metadata={**reward.metadata, REWARD_KEY_FIELD: key})
        applied = await asyncio.to_thread(self.store.add_reward, reward)
        if entry.finished and self.scorer is not None and reward.call_index is None and reward.agent is None:
            written = await asyncio.to_thread(self.scorer.score_rollout, self.store, rollout_id, reuse_model=True)
            applied = written.applied
        return reward, applied

    async def check_agent_reward(self, rollout_id: str, route: str) -> None:
        """A 403, and an event in the store, when the reward configuration says the rollout may not
        report its own reward (`agent_reward = false`: the benchmark or the trainer scores it)."""
        if self.scorer is None or self.scorer.config.agent_reward:
            return
        await asyncio.to_thread(self.store.add_event, Event(
            kind=REWARD_REFUSED, source="gateway", message=f"rollout {rollout_id} sent its own reward ({route})",
            data={"rollout_id": rollout_id, "route": route, "reward_config": self.scorer.hash}))
        raise HTTPError(403, f"the reward configuration {self.scorer.hash} scores rollouts itself "
                             "(agent_reward = false): a rollout may not send its own reward",
                        type="permission_error", code=REWARD_REFUSED)

    def reward_for(self, rollout_id: str, body: dict[str, Any]) -> Reward:
        """The reward `body` describes, as `add_reward` would store it (not stored)."""
        return reward_from(rollout_id, body, scorer=self.scorer)

    async def finish(self, rollout_id: str, body: dict[str, Any], *, default_status: str) -> Rollout:
        status = body.get("status", default_status)
        if status not in (RolloutStatus.SUCCEEDED.value, RolloutStatus.FAILED.value, RolloutStatus.TIMEOUT.value):
            raise HTTPError(400, "status must be 'succeeded', 'failed' or 'timeout'", code="bad_status")
        error = body.get("error")
        if error is not None:  # kept, however it came: a failure's message is worth more than its form
            error = (error if isinstance(error, str) else json.dumps(error))[:4000].replace("\x00", "\ufffd")
        entry = await self.entry(rollout_id, for_call=False)
        if entry.finished:
            stored = await asyncio.to_thread(self.store.get_rollout, rollout_id)
            if stored is not None and stored.status == status:
                return stored  # a retried finish
            was = stored.status.value if stored else "?"
            raise HTTPError(409, f"rollout {rollout_id!r} is already finished ({was})",
                             code="rollout_finished")
        if body.get("reward") is not None:
            await self.check_agent_reward(rollout_id, "POST /rollouts/{id}/finish with a reward")
        reward = (reward_from(rollout_id, {"value": body["reward"]}, scorer=self.scorer)
                  if body.get("reward") is not None else None)
        entry.finished = True  # new calls get 409 from here on
        try:
            done = await self._finish(entry, reward, status, error)
        except BaseException:
            # The store refused (it is down: the client gets 503 and retries). The rollout is still
            # running as far as the store knows, so the retry must find it open, not "finished".
            entry.finished = False
            raise
        self._open.pop(rollout_id, None)
        return done

    async def _finish(self, entry: RolloutEntry, reward: Reward | None, status: str, error: str | None) -> Rollout:
        rollout_id = entry.state.id
        try:
            await asyncio.wait_for(entry.idle.wait(), self.finish_wait_s)
        except asyncio.TimeoutError:
            log.warning("rollout %s finished with calls still in flight", rollout_id)
        if reward is not None and not entry.reward_stored:
            await asyncio.to_thread(self.store.add_reward, reward)
            entry.reward_stored = True
        await asyncio.to_thread(self.store.flush, 30.0)  # its calls are on disk before it shows as finished
        if self.scorer is not None:  # and its final reward is in
            await asyncio.to_thread(self._score, rollout_id, status)
        return await asyncio.to_thread(self.store.finish_rollout, rollout_id, status=status, error=error)


    def _score(self, rollout_id: str, status: str) -> None:
        assert self.scorer is not None
        try:
            self.scorer.score_rollout(self.store, rollout_id, status=status)
        except Exception:  # noqa: BLE001 - the finish goes on: the rollout ends without a final reward
            log.exception("rollout %s could not be scored under reward configuration %s", rollout_id,
                          self.scorer.hash)


def reward_from(rollout_id: str, body: dict[str, Any], *, scorer: Scorer | None = None, late: bool = False) -> Reward:
    """The reward a request body describes: `value`, optional `name`, `final`, `metadata`,
    `call_index` (a per-step reward), `agent` (one agent's reward: never the rollout's final
    reward); with a reward configuration, an input of its components."""
    value = body.get("value", body.get("reward"))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise HTTPError(400, f"reward value must be a finite number, got {repr(value)[:100]}", code="bad_reward")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise HTTPError(400, "metadata must be an object", code="bad_metadata")
    call_index = body.get("call_index")
    if call_index is not None and (isinstance(call_index, bool) or not isinstance(call_index, int)
                                   or not 0 <= call_index <= MAX_INT32):  # the store's column is 32-bit
        raise HTTPError(400, f"call_index must be a call's index (an integer >= 0), got {repr(call_index)[:100]}",
                        code="bad_call_index")
    if call_index is not None and body.get("final"):
        raise HTTPError(400, "a per-step reward (call_index) cannot be final", code="bad_call_index")
    agent = body.get("agent")
    if agent is not None and (not short_text(agent, 128) or not agent.strip()):
        raise HTTPError(400, f"agent must be an agent's name (a string of 1 to 128 characters, no NUL), "
                        f"got {repr(agent)[:150]}", code="bad_agent")
    name = body.get("name")
    if name is not None and not short_text(name):
        raise HTTPError(400, "a reward's name must be a string of at most 255 characters, no NUL", code="bad_reward")
    final = call_index is None and bool(body.get("final", True))
    if scorer is not None and call_index is None and agent is None:
        name, final = name or AGENT, False
    if late:
        metadata = {**metadata, "late": True}
    return Reward(rollout_id=rollout_id, value=float(value), name=name, final=final, created_at=time.time(),
                  metadata=metadata, call_index=call_index, agent=agent)


MAX_INT32 = 2**31 - 1


def check_rollout_id(rid: object) -> None:
    if not is_rollout_id(rid):
        raise HTTPError(400, "a rollout id is 1-64 characters of A-Z a-z 0-9 . _ : -, not only dots",
                        code="bad_rollout_id")
