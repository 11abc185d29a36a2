"""Capture: every LLM call an agent makes, recorded with exact token IDs under its rollout.

`wrap(client)` installs the recording transport on the HTTP client a framework sends through;
`rollout(...)` opens the rollout the calls belong to; the gateway enters through `begin_call`.
"""

from lightning_middleware.capture.calls import CaptureSettings, Source, attempt_of, begin_call, scrub_secrets
from lightning_middleware.capture.context import (
                                                  AGENT_HEADER,
                                                  ROLLOUT_HEADER,
                                                  RolloutHandle,
                                                  RolloutState,
                                                  agent_scope,
                                                  current_agent,
                                                  current_rollout,
                                                  emit_reward,
                                                  propagate,
                                                  rollout,
                                                  rollout_headers,
                                                  set_current_agent,
)
from lightning_middleware.capture.transport import install, installed_settings, is_http_client
from lightning_middleware.capture.wrap import wrap

__all__ = [
    "AGENT_HEADER",
    "ROLLOUT_HEADER",
    "CaptureSettings",
    "RolloutHandle",
    "RolloutState",
    "Source",
    "agent_scope",
    "attempt_of",
    "begin_call",
    "current_agent",
    "current_rollout",
    "emit_reward",
    "install",
    "installed_settings",
    "is_http_client",
    "propagate",
    "rollout",
    "rollout_headers",
    "scrub_secrets",
    "set_current_agent",
    "wrap",
]
