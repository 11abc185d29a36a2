"""The rollout worker entrypoint for a pod (`lightning-mw rollouts worker`): the same `execute_job` a
local worker process runs, for the one job its environment names.

Environment: LIGHTNING_AGENT ("module:function"), LIGHTNING_ROLLOUT_JOB (the RolloutJob as JSON),
LIGHTNING_STORE_URL (the store as this pod reaches it; the gateway URL, if the agent uses one, is
the agent's own env). It writes the outcome as JSON to the termination log (the container's
`terminationMessagePath`, LIGHTNING_TERMINATION_LOG overrides it) and as its last stdout line, and
exits 0 for any agent result, a raised exception included; a non-zero exit means the worker itself
could not run (bad env, agent not importable, killed), and the backend reports its last log lines.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict

from lightning_middleware.controller.backends.k8s_template import ENV_AGENT, ENV_JOB, ENV_STORE, ENV_TERMINATION_LOG
from lightning_middleware.controller.execution import AgentNotFound, execute_job, resolve_agent
from lightning_middleware.controller.jobs import RolloutJob
from lightning_middleware.store import get_store

log = logging.getLogger(__name__)
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def job_from_env(env: Mapping[str, str]) -> RolloutJob:
    missing = [k for k in (ENV_AGENT, ENV_JOB) if not env.get(k)]
    if missing:
        raise ValueError(f"the rollout worker needs {', '.join(missing)} in its environment")
    try:
        data = json.loads(env[ENV_JOB])
        job = RolloutJob(**{**data, "store_url": env.get(ENV_STORE) or data.get("store_url")})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{ENV_JOB} is not a rollout job: {exc}") from None
    if not job.store_url:
        raise ValueError(f"the rollout worker needs {ENV_STORE} (the store URL as this pod reaches it)")
    return job


def run_worker(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        job = job_from_env(env)
        agent = resolve_agent(env[ENV_AGENT])
    except (ValueError, AgentNotFound) as exc:
        print(f"rollout worker: {exc}", file=sys.stderr, flush=True)
        return 2
    store = get_store(job.store_url)
    outcome = execute_job(agent, job, store)
    store.flush(30.0)  # the rollout's rows are in the store before the pod reports success
    text = json.dumps(asdict(outcome), separators=(",", ":"))
    try:
        with open(env.get(ENV_TERMINATION_LOG) or DEFAULT_TERMINATION_LOG, "w") as f:
            f.write(text)
    except OSError as exc:  # not in a pod (no such mount): the store row still has the outcome
        log.warning("cannot write the termination log: %s", exc)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_worker())
