"""A rollout's own agent -> policy map on the gateway.

`POST /rollouts` may carry `policies` ({agent name: served model name}) and `default_policy`.
The rollout's calls (per-rollout URL or `x-rollout-id`) use its map first, then the gateway-wide
`--policy` map, then the rollout's default, then `--default-policy` (`CaptureSettings.policy_for`);
the agent is the `x-agent-name` header, as for the gateway-wide map (docs/policies.md).

The map is kept in the rollout's stored metadata under `METADATA_KEY`: a restarted gateway, or
another gateway on the same store, routes an open rollout's calls the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.asgi.error_replies import HTTPError
from lightning_middleware.capture import RolloutState
from lightning_middleware.gateway.requests import short_text

log = logging.getLogger(__name__)

METADATA_KEY = "lightning_policies"
MAX_POLICIES = 256  # agents per rollout: a map is a team's roles, not a table to store
AGENT_LIMIT, MODEL_LIMIT = 128, 255  # the store's agent_name and model columns


@dataclass(frozen=True)
class RolloutPolicies:
    """Agent name -> served model name, and the model of every other agent (None: no default)."""

    policies: Mapping[str, str] = field(default_factory=dict)
    default_policy: str | None = None

    def __bool__(self) -> bool:
        return bool(self.policies) or self.default_policy is not None

    def as_json(self) -> dict[str, Any]:
        return {"policies": dict(self.policies), "default_policy": self.default_policy}

    def apply(self, state: RolloutState) -> None:
        """Route the rollout's calls by this map (`begin_call` reads it from the state)."""
        state.policies = dict(self.policies)
        state.default_policy = self.default_policy


def _name(value: object, limit: int) -> bool:
    return short_text(value, limit) and bool(str(value).strip())


def _bad(message: str, param: str = "policies") -> HTTPError:
    return HTTPError(400, message, code="bad_policies", param=param)


def policies_from_body(body: Mapping[str, Any]) -> RolloutPolicies:
    """The map a `POST /rollouts` body asks for; a 400 naming the problem for a bad one."""
    policies = body.get("policies")
    if policies is None:
        policies = {}
    if not isinstance(policies, dict):
        raise _bad(f"policies must be an object of agent name -> served model name, got {type(policies).__name__}")
    if len(policies) > MAX_POLICIES:
        raise _bad(f"policies maps at most {MAX_POLICIES} agents, got {len(policies)}")
    for agent, model in policies.items():
        if not _name(agent, AGENT_LIMIT):
            raise _bad(f"policies: an agent name is 1 to {AGENT_LIMIT} characters, not blank, no NUL; "
                       f"got {agent[:150]!r}")
        if not _name(model, MODEL_LIMIT):
            raise _bad(f"policies[{agent!r}] must be a served model name (a string of 1 to {MODEL_LIMIT} "
                       f"characters, not blank, no NUL), got {repr(model)[:150]}")
    default = body.get("default_policy")
    if default is not None and not _name(default, MODEL_LIMIT):
        raise _bad(f"default_policy must be a served model name (a string of 1 to {MODEL_LIMIT} characters, "
                   f"not blank, no NUL) or null, got {repr(default)[:150]}", "default_policy")
    return RolloutPolicies(dict(policies), default)


def with_policies(metadata: dict[str, Any], policies: RolloutPolicies) -> dict[str, Any]:
    """The rollout metadata to store: the caller's, plus the map when there is one."""
    if METADATA_KEY in metadata:
        raise HTTPError(400, f"metadata key {METADATA_KEY!r} is the gateway's own: send the map as "
                        "top-level policies / default_policy", code="bad_metadata")
    return {**metadata, METADATA_KEY: policies.as_json()} if policies else metadata


def policies_from_metadata(metadata: Mapping[str, Any] | None) -> RolloutPolicies:
    """The map a stored rollout carries (none: an empty map). A stored map that is not one this
    module wrote is ignored with a warning: routing falls back to the gateway-wide map."""
    found = (metadata or {}).get(METADATA_KEY)
    if found is None:
        return RolloutPolicies()
    try:
        if not isinstance(found, dict):
            raise HTTPError(400, f"{METADATA_KEY} is not an object")
        return policies_from_body(found)
    except HTTPError as exc:
        log.warning("a stored rollout's %s is not a policy map (%s); ignoring it", METADATA_KEY, exc)
        return RolloutPolicies()
