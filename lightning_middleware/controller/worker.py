"""The rollout worker entrypoint for a pod (`lightning-mw rollouts worker`): the same `execute_job` a
local worker process runs, for the job (or the batch of jobs) its environment names.

Environment: LIGHTNING_AGENT ("module:function"), LIGHTNING_ROLLOUT_JOB (the RolloutJob as JSON) or
LIGHTNING_ROLLOUT_JOBS (a batch: a JSON list of them, run one after another, each with its own
timeout, or LIGHTNING_ROLLOUT_CONCURRENCY at a time), LIGHTNING_STORE_URL (the store as this pod
reaches it; the gateway URL, if the agent uses one, is the agent's own env). It writes the outcome
as JSON to the termination log (the container's `terminationMessagePath`, LIGHTNING_TERMINATION_LOG
overrides it) and as its last stdout line; a batch's termination log is rewritten as each rollout
starts and ends (the outcomes so far and the rollouts running), so a pod killed mid-batch still
reports what finished. It exits 0 for any agent result, a raised exception included; a non-zero
exit means the worker itself could not run (bad env, agent not importable, killed), and the backend
reports its last log lines.

A pod that reaches only the gateway (KubernetesBackend(gateway=...)) has no store URL: its
environment names LIGHTNING_GATEWAY_URL, LIGHTNING_ROLLOUT_ID, and the rollout's own route and
token as OPENAI_BASE_URL and OPENAI_API_KEY (a rollout-scoped token, asgi/auth.py). The gateway
records its calls; the worker runs the agent unrecorded and reports the number it returned, which
the backend posts to the gateway.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from lightning_middleware.controller.backends.k8s_batch import batch_message
from lightning_middleware.controller.backends.k8s_template import (
    ENV_AGENT,
    ENV_CONCURRENCY,
    ENV_GATEWAY,
    ENV_JOB,
    ENV_JOBS,
    ENV_STORE,
    ENV_TERMINATION_LOG,
)
from lightning_middleware.controller.execution import (
    AgentFn,
    AgentNotFound,
    aexecute_job,
    execute_job,
    execute_unrecorded,
    resolve_agent,
)
from lightning_middleware.controller.jobs import RolloutJob, RolloutOutcome
from lightning_middleware.store import TraceStore, get_store

log = logging.getLogger(__name__)
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def jobs_from_env(env: Mapping[str, str]) -> list[RolloutJob]:
    """The job(s) a pod runs; a ValueError that names what is missing or malformed."""
    key = ENV_JOBS if env.get(ENV_JOBS) else ENV_JOB
    if not env.get(ENV_AGENT) or not env.get(key):
        missing = [k for k in (ENV_AGENT, ENV_JOB) if not env.get(k)]
        raise ValueError(f"the rollout worker needs {', '.join(missing)} in its environment "
                         f"({ENV_JOBS} for a batch)")
    try:
        data = json.loads(env[key])
        items = data if key == ENV_JOBS else [data]
        if not isinstance(items, list) or not items:
            raise ValueError("expected a non-empty JSON list")
        jobs = [RolloutJob(**{**item, "store_url": env.get(ENV_STORE) or item.get("store_url")}) for item in items]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key} is not a rollout job: {exc}") from None
    if not env.get(ENV_GATEWAY) and not all(job.store_url for job in jobs):
        raise ValueError(f"the rollout worker needs {ENV_STORE} (the store URL as this pod reaches it), or "
                         f"{ENV_GATEWAY} for a pod that reaches only the gateway")
    return jobs


def run_worker(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        jobs = jobs_from_env(env)
        agent = resolve_agent(env[ENV_AGENT])
    except (ValueError, AgentNotFound) as exc:
        print(f"rollout worker: {exc}", file=sys.stderr, flush=True)
        return 2
    path = env.get(ENV_TERMINATION_LOG) or DEFAULT_TERMINATION_LOG
    if env.get(ENV_GATEWAY) and not jobs[0].store_url:  # the gateway records the rollout
        if len(jobs) > 1:
            print("rollout worker: a pod that reaches only the gateway runs one rollout", file=sys.stderr, flush=True)
            return 2
        text = json.dumps(asdict(execute_unrecorded(agent, jobs[0])), separators=(",", ":"))
        _report(path, text)
        print(text, flush=True)
        return 0
    store = get_store(jobs[0].store_url)
    if not env.get(ENV_JOBS):
        outcome = execute_job(agent, jobs[0], store)
        store.flush(30.0)  # the rollout's rows are in the store before the pod reports success
        text = json.dumps(asdict(outcome), separators=(",", ":"))
        _report(path, text)
        print(text, flush=True)
        return 0
    concurrency = int(env.get(ENV_CONCURRENCY) or 1)
    if concurrency > 1:
        asyncio.run(_run_concurrently(agent, jobs, store, path, concurrency))
    else:
        _run_batch(agent, jobs, store, path)
    return 0


def _run_batch(agent: AgentFn, jobs: list[RolloutJob], store: TraceStore, path: str) -> None:
    # One after another in this main thread, so each rollout's own SIGALRM timeout works as it does
    # for a single job; an agent error or timeout ends that rollout only.
    done: dict[str, RolloutOutcome] = {}
    for job in jobs:
        _report(path, batch_message(done, [job.rollout_id]))
        outcome = execute_job(agent, job, store)
        store.flush(30.0)  # in the store before it is reported: a cut message falls back to the store
        _finished(job, outcome, done, [], path)


def _finished(job: RolloutJob, outcome: RolloutOutcome, done: dict[str, RolloutOutcome], running: list[str],
              path: str) -> None:
    done[job.rollout_id] = outcome
    _report(path, batch_message(done, running))
    print(json.dumps({"rollout_id": job.rollout_id, **asdict(outcome)}, separators=(",", ":")), flush=True)


async def _run_concurrently(agent: AgentFn, jobs: list[RolloutJob], store: TraceStore, path: str,
                            concurrency: int) -> None:
    """Up to `concurrency` rollouts at once, started in order. An async agent's timeout cancels it; a
    sync agent runs in a thread, which cannot be interrupted: past its timeout its late end is
    recorded as a timeout (as the thread backend does), and the Job's deadline bounds the pod."""
    slots = asyncio.Semaphore(concurrency)
    done: dict[str, RolloutOutcome] = {}
    running: list[str] = []
    loop = asyncio.get_running_loop()
    threads = ThreadPoolExecutor(concurrency + 1, thread_name_prefix="rollout")  # the default pool is CPU-sized

    async def one(job: RolloutJob) -> None:
        async with slots:
            running.append(job.rollout_id)
            _report(path, batch_message(done, running))
            if inspect.iscoroutinefunction(agent):
                outcome = await aexecute_job(agent, job, store)
            else:
                outcome = await loop.run_in_executor(threads, execute_job, agent, job, store)
            await loop.run_in_executor(threads, store.flush, 30.0)
            running.remove(job.rollout_id)
            _finished(job, outcome, done, running, path)  # on the loop: one writer of `done` and the file

    try:
        await asyncio.gather(*(one(job) for job in jobs))
    finally:
        threads.shutdown(wait=False)


def _report(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:  # in place: /dev/termination-log is a mounted file, not replaceable
            f.write(text)
    except OSError as exc:  # not in a pod (no such mount): the store rows still have the outcomes
        log.warning("cannot write the termination log: %s", exc)


if __name__ == "__main__":
    sys.exit(run_worker())
