"""Records to database rows and back (token IDs and logprobs packed, JSON serialised once)."""

from __future__ import annotations

import binascii
import logging
import struct
import time
from typing import Any

import sqlalchemy as sa

from lightning_middleware import fastjson
from lightning_middleware.records import Choice, LLMCall, PolicyVersion, Reward, Rollout
from lightning_middleware.store import schema as S
from lightning_middleware.store.codec import (
    floats_to_text,
    ints_to_text,
    pack_floats,
    pack_ints,
    text_to_floats,
    text_to_ints,
    unpack_floats,
    unpack_ints,
)

log = logging.getLogger(__name__)

CALL_COLUMNS = tuple(c.name for c in S.llm_calls.columns)
_JSON_COLUMNS = {"request", "response"}
INSERT_CALLS_QMARK = f"INSERT INTO llm_calls ({', '.join(CALL_COLUMNS)}) VALUES ({', '.join('?' * len(CALL_COLUMNS))})"
COPY_CALLS = f"COPY llm_calls ({', '.join(CALL_COLUMNS)}) FROM STDIN (FORMAT BINARY)"


def _pg_type(column: sa.Column) -> str:
    """The PostgreSQL type name of a column, for binary COPY (which needs exact types)."""
    t = column.type
    # JSON columns get our pre-serialised text: json's binary input *is* its text.
    if isinstance(t, sa.LargeBinary):
        return "bytea"
    if isinstance(t, sa.Boolean):
        return "bool"
    if isinstance(t, sa.Integer):
        return "int4"
    if isinstance(t, sa.Float):
        return "float8"
    return "text"


CALL_PG_TYPES = [_pg_type(c) for c in S.llm_calls.columns]


def _json_text(value: Any) -> str | None:
    return None if value is None else fastjson.dumps_stored(value)


# The choices after the first of a request with n > 1 (`LLMCall.extra_choices`) are kept inside
# the response JSON under this key, their token IDs and logprobs packed as the columns pack
# choice 0's (base64 text). Inside the JSON rather than in a new column: every store, whatever
# its age, reads and writes them with no migration, an older reader sees one unknown field, and
# calls with n = 1 (nearly all) pay nothing.
EXTRA_CHOICES_KEY = "lightning_extra_choices"


# The request a translated call's caller sent (`LLMCall.source_format` / `source_request`: a
# Responses API or Anthropic Messages request, sent to the engine as chat completions) is kept
# inside the request JSON under this key, for the same reasons as the extra choices: no migration,
# and the chat request beside it stays what every reader of `request` expects.
SOURCE_KEY = "lightning_source"


def _request_text(call: LLMCall) -> str | None:
    if call.source_format is None:
        return _json_text(call.request)
    source = {"format": call.source_format, "request": call.source_request}
    return fastjson.dumps_stored({**(call.request or {}), SOURCE_KEY: source})


def split_request(stored: Any) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
    """A stored request JSON as (the chat request, the caller's format, the caller's request)."""
    if not isinstance(stored, dict) or SOURCE_KEY not in stored:
        return stored or {}, None, None
    request = {k: v for k, v in stored.items() if k != SOURCE_KEY}
    source = stored[SOURCE_KEY]
    if not isinstance(source, dict) or not isinstance(source.get("format"), str):
        log.warning("a stored request's source is unreadable; reading the call without it")
        return request, None, None
    original = source.get("request")
    return request, source["format"], original if isinstance(original, dict) else None


def _response_text(call: LLMCall) -> str | None:
    if not call.extra_choices:
        return _json_text(call.response)
    extras = [_choice_json(c) for c in call.extra_choices]
    return fastjson.dumps_stored({**(call.response or {}), EXTRA_CHOICES_KEY: extras})


def _choice_json(c: Choice) -> dict[str, Any]:
    out: dict[str, Any] = {"index": c.index, "token_ids": ints_to_text(c.completion_token_ids),
                           "finish_reason": c.finish_reason}
    if c.logprobs is not None:
        out["logprobs"] = floats_to_text(c.logprobs)
    return out


def split_response(stored: Any) -> tuple[dict[str, Any] | None, tuple[Choice, ...]]:
    """A stored response JSON as (the response, the extra choices kept inside it)."""
    if not isinstance(stored, dict) or EXTRA_CHOICES_KEY not in stored:
        return stored, ()
    response = {k: v for k, v in stored.items() if k != EXTRA_CHOICES_KEY}
    try:
        extras = tuple(Choice(index=int(c["index"]), completion_token_ids=text_to_ints(c["token_ids"]),
                              logprobs=text_to_floats(c["logprobs"]) if c.get("logprobs") is not None else None,
                              finish_reason=c.get("finish_reason"))
                       for c in stored[EXTRA_CHOICES_KEY])
    except (KeyError, TypeError, ValueError, binascii.Error, struct.error):
        log.warning("a stored response's extra choices are unreadable; reading the call without them")
        extras = ()
    return response or None, extras  # `or None`: a record without a response was stored as only the key


def fit_text(value: Any, limit: int | None = None) -> str | None:
    """A value for a text column, as every database takes it: a string (a server's or a client's
    field may be any JSON), no NUL (PostgreSQL refuses one in text), at most `limit` characters
    (PostgreSQL enforces a VARCHAR's length). A record is kept shortened rather than refused."""
    if value is None:
        return None
    text = value if isinstance(value, str) else fastjson.dumps(value)
    text = text.replace("\x00", "\ufffd")
    return text if limit is None else text[:limit]


_LIMITS = {c.name: getattr(c.type, "length", None) for c in S.llm_calls.columns}


def call_tuple(call: LLMCall) -> tuple[Any, ...]:
    """One llm_calls row in CALL_COLUMNS order, ready for the driver. Built as one tuple literal
    (the ingestion hot path: a dict of the columns, then reordered, cost ~1 us a span);
    `_CALL_ORDER` below keeps the order honest.

    Blobs are bytearrays and flags 0/1: CPython's sqlite3 binds an exact int, float, str or
    bytearray as it is and looks any other type (bytes, bool) up in its adapter registry first
    (a sixth of the writer thread in the profile, docs/benchmarks.md); psycopg's COPY takes both."""
    prompt, completion = call.prompt_token_ids, call.completion_token_ids
    return (
        call.id, call.rollout_id, call.call_index, call.attempt, call.endpoint,
        fit_text(call.model, _LIMITS["model"]), fit_text(call.agent_name, _LIMITS["agent_name"]),
        _request_text(call), _response_text(call),
        _blob(pack_ints(prompt) if prompt else None), _blob(pack_ints(completion) if completion else None),
        _blob(pack_floats(call.logprobs)), fit_text(call.finish_reason, _LIMITS["finish_reason"]), call.status_code,
        1 if call.stream else 0, 1 if call.partial else 0, 1 if call.is_training else 0, fit_text(call.error),
        call.latency_s, call.started_at, call.policy_version, call.request_hash,
        fit_text(call.idempotency_key, _LIMITS["idempotency_key"]),
    )


def _blob(packed: bytes | None) -> bytearray | None:
    return None if packed is None else bytearray(packed)


_CALL_ORDER = ("id", "rollout_id", "call_index", "attempt", "endpoint", "model", "agent_name", "request",
               "response", "prompt_token_ids", "completion_token_ids", "logprobs", "finish_reason", "status_code",
               "stream", "partial", "is_training", "error", "latency_s", "started_at", "policy_version",
               "request_hash", "idempotency_key")
if _CALL_ORDER != CALL_COLUMNS:  # a column added to the schema needs its place in call_tuple
    raise RuntimeError(f"call_tuple's columns {_CALL_ORDER} are not the schema's {CALL_COLUMNS}")


def call_record(row: sa.Row) -> LLMCall:
    m = row._mapping
    response, extras = split_response(m["response"])
    request, source_format, source_request = split_request(m["request"])
    return LLMCall(
        id=m["id"],
        rollout_id=m["rollout_id"],
        call_index=m["call_index"],
        attempt=m["attempt"],
        endpoint=m["endpoint"],
        model=m["model"],
        agent_name=m["agent_name"],
        request=request,
        response=response,
        prompt_token_ids=unpack_ints(m["prompt_token_ids"]),
        completion_token_ids=unpack_ints(m["completion_token_ids"]),
        logprobs=unpack_floats(m["logprobs"]),
        finish_reason=m["finish_reason"],
        status_code=m["status_code"],
        stream=bool(m["stream"]),
        partial=bool(m["partial"]),
        is_training=bool(m["is_training"]),
        error=m["error"],
        latency_s=m["latency_s"],
        started_at=m["started_at"],
        policy_version=m["policy_version"],
        request_hash=m["request_hash"],
        extra_choices=extras,
        source_format=source_format,
        source_request=source_request,
        idempotency_key=m["idempotency_key"],
    )


def rollout_row(r: Rollout) -> dict[str, Any]:
    return {
        "id": r.id,
        "task_id": r.task_id,
        "mode": r.mode.value,
        "status": r.status.value,
        "input": r.input,
        "metadata": r.metadata or None,
        "final_reward": r.final_reward,
        "policy_version": r.policy_version,
        "created_at": r.created_at or time.time(),
        "ended_at": r.ended_at,
        "duration_s": r.duration_s,
        "error": r.error,
        "claimed_by": r.claimed_by,
        "consumed_step": r.consumed_step,
    }


def rollout_record(row: sa.Row) -> Rollout:
    m = dict(row._mapping)
    m["metadata"] = m["metadata"] or {}
    return Rollout(**m)


def policy_row(pv: PolicyVersion) -> dict[str, Any]:
    return {"version": pv.version, "trainer_id": pv.trainer_id, "path": pv.path, "checksum": pv.checksum,
            "created_at": pv.created_at or time.time(), "metadata": pv.metadata or None}


def reward_row(reward: Reward) -> dict[str, Any]:
    return {
        "rollout_id": reward.rollout_id, "value": float(reward.value), "name": reward.name,
        "final": bool(reward.final), "created_at": reward.created_at or time.time(),
        "metadata": reward.metadata or None, "call_index": reward.call_index, "config_hash": reward.config_hash,
        "agent": reward.agent,
    }


def reward_record(row: sa.Row) -> Reward:
    m = row._mapping
    return Reward(
        id=m["id"], rollout_id=m["rollout_id"], value=m["value"], name=m["name"],
        final=bool(m["final"]), created_at=m["created_at"], metadata=m["metadata"] or {},
        call_index=m["call_index"], config_hash=m["config_hash"], agent=m["agent"],
    )
