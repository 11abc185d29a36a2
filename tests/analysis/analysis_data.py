"""A small but realistic store for the analysis, export and notebook tests.

Real rollouts go through `wrap()` against the deterministic `LLMTestServer`
(the tool-loop agent of `lightning_middleware.example`); a training run is
stood in for by policy versions and train steps written through the store API.
"""

from __future__ import annotations

import uuid
from typing import Any

import openai

from lightning_middleware import PolicyVersion, TraceStore, TrainStep, agent_scope, rollout, wrap
from lightning_middleware.example import tool_agent
from lightning_middleware.records import STEP_METRICS

TASKS = ("add", "capital", "sort", "weather")
GROUP = 3
VERSIONS = (0, 1, 2)


def reward_for(task_i: int, sample: int, version: int) -> float:
    """Rewards rise with the policy version, so the curves in the notebooks go somewhere."""
    score = (task_i + sample) % 3
    return 1.0 if score <= version else (0.5 if score == version + 1 else 0.0)


def build(store: TraceStore, base_url: str) -> dict[str, Any]:
    """Fill `store`; returns what was made (ids by kind) for assertions."""
    client = wrap(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=2), store=store)
    made: dict[str, Any] = {"train": [], "val": [], "failed": None, "retry": None, "multi": None, "broken": None}
    step = 0
    for version in VERSIONS:
        batch = []
        for ti, task in enumerate(TASKS):
            for sample in range(GROUP):
                with rollout(task, input={"q": f"{task} #{sample}"}, policy_version=version, store=store) as r:
                    tool_agent(client, f"please do {task} sample {sample}")
                    r.reward(reward_for(ti, sample, version))
                batch.append(r.id)
        made["train"] += batch
        store.add_policy_version(PolicyVersion(version=version + 1, path=f"/ckpt/v{version + 1}",
                                               checksum=f"sha-{version + 1}", metadata={"step": step + 1}))
        step += 1
        store.commit_train_step(TrainStep(
            step=step, policy_version=version + 1, trainer_id="trainer-0", rollout_ids=tuple(batch),
            metrics=step_metrics(step)))
        for task in TASKS[:2]:  # an evaluation pass after each step
            with rollout(task, mode="val", policy_version=version + 1, store=store) as r:
                tool_agent(client, f"evaluate {task}")
                r.reward(1.0 if version >= 1 else 0.0, name="exact_match")
            made["val"].append(r.id)

    # A rollout whose agent raises after its first call.
    try:
        with rollout("crash", policy_version=3, store=store) as r:
            client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "boom"}])
            raise RuntimeError("tool exploded")
    except RuntimeError:
        pass
    made["failed"] = r.id

    # A retried call: the server fails the first attempt with 500, the client retries.
    with rollout("retry", policy_version=3, store=store) as r:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "flaky"}],
                                       user=uuid.uuid4().hex,  # a fresh body: the server counts failures per body
                                       extra_headers={"x-test-fail-times": "1"})
        r.reward(1.0)
    made["retry"] = r.id

    # Two named agents in one rollout, plus an intermediate (non-final) reward.
    with rollout("team", policy_version=3, store=store) as r:
        with agent_scope("planner"):
            tool_agent(client, "plan the trip")
        with agent_scope("writer"):
            client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "write it"}])
        r.reward(0.2, name="format", final=False)
        r.reward(0.75)
    made["multi"] = r.id

    # Context rewritten between calls: a prefix break.
    with rollout("summarise", policy_version=3, store=store) as r:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "long story"}])
        client.chat.completions.create(model="test-model", messages=[
            {"role": "system", "content": "summary so far: short"}, {"role": "user", "content": "go on"}])
        r.reward(0.0)
    made["broken"] = r.id
    store.flush()
    return made


def step_metrics(step: int) -> dict[str, float]:
    """A trainer step's metrics under the names the daemon writes (records.STEP_METRICS), each
    moving with the step so a plot of it is not flat."""
    return {name: round(1.0 / step + 0.01 * k, 6) for k, name in enumerate(STEP_METRICS)}
