"""A rollout as a reward function sees it: read from the store, never from the agent's memory,
so a rollout scored at its end and the same rollout re-scored a month later see the same thing.

The calls are the counted attempts (`rows.counted_attempts`: the attempt of each call that
training, metrics and export count). Tool calls are read from the responses (choice 0), tool
results from the later requests (`role: "tool"` messages; `function_call_output` items of the
Responses API), so the result of a tool the agent ran after its last LLM call is not seen.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_middleware.records import LLMCall, Reward, Rollout, RolloutStatus
from lightning_middleware.rewards.config import AGENT
from lightning_middleware.rows import counted_attempts
from lightning_middleware.store import TraceStore

HUMAN = "human"  # the name human labels are stored under
PROTECTED = "protected_files"  # the name `protect.ProtectedFiles` reports changed files under


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # as the model wrote it
    call_index: int
    id: str | None = None
    parsed: dict[str, Any] | None = None  # the arguments if they are a JSON object
    offered: bool = False  # the name is among the request's tools

    @property
    def valid(self) -> bool:
        return self.parsed is not None and self.offered

    def key(self) -> tuple[str, str]:
        """(name, canonical arguments): identical calls have the same key."""
        args = json.dumps(self.parsed, sort_keys=True) if self.parsed is not None else self.arguments.strip()
        return self.name, args


@dataclass(frozen=True)
class ToolResult:
    content: str
    call_index: int  # the call whose request first carried it
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Trajectory:
    rollout: Rollout
    calls: tuple[LLMCall, ...]
    tool_calls: tuple[ToolCall, ...]
    tool_results: tuple[ToolResult, ...]
    messages: tuple[dict[str, Any], ...]  # the last call's conversation, its reply included
    replies: tuple[str, ...]  # the text of every counted call's reply, in order
    final_output: str | None
    rewards: tuple[Reward, ...]  # every reward stored for the rollout so far

    @property
    def status(self) -> RolloutStatus:
        return self.rollout.status

    @property
    def reported(self) -> dict[str, float]:
        """The rewards the agent reported itself (no configuration, no call, not a person's),
        the last of each name; an unnamed one as "agent"."""
        out: dict[str, float] = {}
        for r in self.rewards:
            if r.config_hash is None and r.call_index is None and r.agent is None and r.name not in (HUMAN, PROTECTED):
                out[r.name or AGENT] = r.value
        return out

    @property
    def reported_reward(self) -> float | None:
        """The agent's own reward: the one named "agent" (or unnamed), else the last final one."""
        reported = self.reported
        if AGENT in reported:
            return reported[AGENT]
        finals = [r.value for r in self.rewards if r.sets_final_reward and r.config_hash is None and r.name != HUMAN]
        return finals[-1] if finals else None

    @property
    def step_rewards(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for r in self.rewards:
            if r.call_index is not None:
                out[r.call_index] = out.get(r.call_index, 0.0) + r.value
        return out

    @property
    def agent_rewards(self) -> dict[str, float]:
        """Agent name -> its latest final per-agent reward (multi-agent rollouts)."""
        return {str(r.agent): r.value for r in self.rewards if r.agent is not None and r.final}

    @property
    def human_labels(self) -> tuple[Reward, ...]:
        """A person's labels (the configured "human" component, which has a hash, is not one)."""
        return tuple(r for r in self.rewards if r.name == HUMAN and r.config_hash is None)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _offered(call: LLMCall) -> set[str]:
    names = set()
    for t in (call.request or {}).get("tools") or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and fn.get("name"):
            names.add(str(fn["name"]))
    return names


def _parse(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _reply(call: LLMCall) -> tuple[dict[str, Any] | None, list[tuple[str, str, str | None]]]:
    """The reply message of a call (chat shape) and its tool calls as (name, arguments, id)."""
    response = call.response or {}
    if call.endpoint == "responses":
        text, tools = [], []
        for item in response.get("output") or []:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call":
                tools.append((str(item.get("name", "")), str(item.get("arguments", "")), item.get("call_id")))
            elif item.get("type") == "message":
                text.append(_text(item.get("content")))
        return {"role": "assistant", "content": "".join(text)}, tools
    choices = response.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None, []
    first = choices[0]
    if "text" in first and "message" not in first:  # completions
        return {"role": "assistant", "content": str(first.get("text") or "")}, []
    message = dict(first.get("message") or {})
    tools = []
    for tc in message.get("tool_calls") or []:
        fn = (tc or {}).get("function") or {}
        tools.append((str(fn.get("name", "")), str(fn.get("arguments", "")), (tc or {}).get("id")))
    return message, tools


def _request_messages(call: LLMCall) -> list[dict[str, Any]]:
    request = call.request or {}
    if call.endpoint == "responses":
        items = request.get("input")
        if isinstance(items, str):
            return [{"role": "user", "content": items}]
        return [i for i in items or [] if isinstance(i, dict)]
    return [m for m in request.get("messages") or [] if isinstance(m, dict)]


def _results(call: LLMCall, names: dict[str, str]) -> list[ToolResult]:
    out = []
    for m in _request_messages(call):
        if m.get("role") == "tool":
            tid = m.get("tool_call_id")
            out.append(ToolResult(_text(m.get("content")), call.call_index, tid, m.get("name") or names.get(tid or "")))
        elif m.get("type") == "function_call_output":
            tid = m.get("call_id")
            out.append(ToolResult(_text(m.get("output")), call.call_index, tid, names.get(tid or "")))
    return out


def build_trajectory(rollout: Rollout, calls: Sequence[LLMCall], rewards: Sequence[Reward]) -> Trajectory:
    """The trajectory of a rollout from its stored calls (any order) and rewards."""
    counted = sorted(counted_attempts(calls), key=lambda c: (c.call_index, c.started_at))
    tool_calls: list[ToolCall] = []
    replies: list[str] = []
    names: dict[str, str] = {}
    results: list[ToolResult] = []
    seen: set[tuple[str | None, str]] = set()
    last_reply: dict[str, Any] | None = None
    for call in counted:
        for result in _results(call, names):
            if (result.tool_call_id, result.content) not in seen:
                seen.add((result.tool_call_id, result.content))
                results.append(result)
        message, tools = _reply(call)
        offered = _offered(call)
        for name, arguments, tid in tools:
            tool_calls.append(ToolCall(name, arguments, call.call_index, tid, _parse(arguments), name in offered))
            if tid:
                names[str(tid)] = name
        last_reply = message
        replies.append(_text((message or {}).get("content")))
    messages: tuple[dict[str, Any], ...] = ()
    if counted:
        messages = tuple(_request_messages(counted[-1])) + ((last_reply,) if last_reply else ())
    final = replies[-1] if replies else None
    return Trajectory(rollout, tuple(counted), tuple(tool_calls), tuple(results), messages, tuple(replies),
                      final, tuple(rewards))


def load_trajectory(store: TraceStore, rollout_id: str, *, status: RolloutStatus | str | None = None) -> Trajectory:
    """The stored trajectory of one rollout; `status` stands in for the stored one (a rollout
    scored as it ends is still `running` in the store). KeyError if there is no such rollout."""
    rollout = store.get_rollout(rollout_id)
    if rollout is None:
        raise KeyError(f"no rollout {rollout_id!r} in {store.safe_url}")
    if status is not None:
        rollout = replace(rollout, status=RolloutStatus(status))
    return build_trajectory(rollout, store.calls(rollout_id), store.rewards(rollout_id))


def load_trajectories(store: TraceStore, rollouts: Sequence[Rollout]) -> list[Trajectory]:
    """The trajectories of many rollouts, with two queries."""
    ids = [r.id for r in rollouts]
    calls = store.calls_for(ids)
    rewards = store.rewards_for(ids)
    return [build_trajectory(r, calls.get(r.id, []), rewards.get(r.id, [])) for r in rollouts]
