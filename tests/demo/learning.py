"""The served policy's preference for the completions its rewards favoured (the demos' CI tests).

A held-out success rate needs hundreds of sampled episodes, twice, to see a gain of a few points
through the sampling noise. This asks the same question of the data the trainer already has, with
no sampling at all: after RL, does the *served* model give the trained rollouts' better-than-their-
group completions more probability, relative to their worse ones, than the policy that sampled them?

One unit per trained rollout (per agent in it, where the store has per-agent rewards). A is its
reward (the agent's own, else the rollout's) minus the mean of its group (same step, task and
agent); D is log p_now(completion) - log p_sampled(completion), summed over its completion tokens,
on the rows the trainer builds from its calls: p_sampled is what each call recorded, p_now the vLLM
server's prompt log-probs (one request a row, the group's shared prompt read from the prefix cache)
under the name the calls were served by (a LoRA policy's adapter, or the model). mean(A * D) is
how much the served policy's token-summed log-likelihood moved toward the better rollouts, which is
what a policy-gradient step pushes up: RL that works makes it > 0; a flipped sign, a loss on the
wrong tokens or a publish that never reached the server makes it <= 0 (or exactly 0). A per-token
mean instead of the sum dilutes the few tokens that decide an episode among its format tokens: on
one guess-demo run of 10 steps (640 units) the sum's z was 8.4 and the mean's 2.7.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from lightning_middleware import LLMCall, TraceStore
from lightning_middleware.rows import build_rows

if TYPE_CHECKING:
    from trainer_backend.demo.run import DemoRun


@dataclass(frozen=True)
class Preference:
    mean: float  # mean of A * D over the units (nats)
    stderr: float  # its standard error over the units
    n: int  # (rollout, agent) units with a nonzero advantage
    moved: float  # mean |D|: how far the served policy moved on them (nats)

    @property
    def z(self) -> float:
        return self.mean / self.stderr if self.stderr > 0 else math.inf * (1 if self.mean > 0 else -1)


def served_logprobs(server_url: str, model: str, ids: Sequence[int], *, read_cache: bool = True) -> list[float | None]:
    """log p(ids[i] | ids[:i]) for i >= 1 under the weights the server holds now (index 0: 0.0).

    With `read_cache`, the positions the server's prefix cache held are None: they are not computed
    (vLLM returns uninitialised values there; usage says how many prompt tokens the cache held).
    Reading the cache is what makes the probe cheap: a group's rows share their prompt, which the
    OpenAI routes recompute for every request with prompt log-probs (on a 700-token prompt, 8 rows:
    38 s against 2.6 s here); the token-in route takes the sampling parameter that reads it."""
    params = {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0, "detokenize": False,
              "skip_reading_prefix_cache": not read_cache}
    body = {"model": model, "token_ids": list(ids), "sampling_params": params, "output_mode": "tokens"}
    reply = httpx.post(f"{server_url}/inference/v1/generate", json=body, timeout=300)
    if read_cache and reply.status_code == 400 and "not JSON compliant" in reply.text:
        # one of those uninitialised values was a NaN or an infinity, which the server cannot send
        return served_logprobs(server_url, model, ids, read_cache=False)
    reply.raise_for_status()
    out = reply.json()
    cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    per_position = out["prompt_logprobs"]
    # position i's log-prob comes from position i - 1's logits: computed for i > cached
    return [0.0] + [None if i <= cached else per_position[i][str(tok)]["logprob"]
                    for i, tok in enumerate(ids) if i > 0]


class PreferenceProbe:
    """`run_demo(..., after_train=probe)`: measures the preference while the trained policy is served."""

    def __init__(self) -> None:
        self.result: Preference | None = None

    def __call__(self, run: DemoRun) -> None:
        assert run.store is not None and run.server is not None
        self.result = served_preference(run.store, run.server.url)


def served_preference(store: TraceStore, server_url: str) -> Preference:
    units: dict[tuple[str, str | None], tuple[tuple[int, str, str | None], float]] = {}  # -> (group, reward)
    calls: dict[str, list[LLMCall]] = {}
    for step in store.train_steps():
        rollouts = [r for r in (store.get_rollout(rid) for rid in step.rollout_ids) if r is not None]
        per_agent = store.agent_rewards([r.id for r in rollouts])
        calls.update(store.calls_for([r.id for r in rollouts], training_only=True))
        for r in rollouts:
            assert r.final_reward is not None, r.id
            for agent in {c.agent_name for c in calls.get(r.id, ())}:
                reward = per_agent.get(r.id, {}).get(agent or "", r.final_reward)
                units[(r.id, agent)] = ((step.step, r.task_id, agent), float(reward))
    groups: dict[tuple[int, str, str | None], list[float]] = defaultdict(list)
    for group, reward in units.values():
        groups[group].append(reward)
    weighted = {u: reward - statistics.fmean(groups[group]) for u, (group, reward) in units.items()}
    weighted = {u: a for u, a in weighted.items() if a != 0.0}
    # A group at a time per thread, its rows one after another: the first computes the group's
    # shared prompt into the prefix cache, the others read it.
    by_group: dict[tuple[int, str, str | None], list[tuple[str, str | None]]] = defaultdict(list)
    for u in weighted:
        by_group[units[u][0]].append(u)

    def score(members: list[tuple[str, str | None]]) -> list[tuple[tuple[str, str | None], float]]:
        return [(u, _move(server_url, u[0], calls[u[0]], u[1])) for u in members]

    with ThreadPoolExecutor(8) as pool:
        moves = dict(pair for pairs in pool.map(score, by_group.values()) for pair in pairs)
    values = [a * moves[u] for u, a in weighted.items()]
    assert len(values) >= 2, f"RL trained {len(values)} rollouts with a nonzero advantage"
    return Preference(mean=statistics.fmean(values), stderr=statistics.stdev(values) / math.sqrt(len(values)),
                      n=len(values), moved=statistics.fmean(abs(m) for m in moves.values()))


def _move(server_url: str, rollout_id: str, calls: list[LLMCall], agent: str | None) -> float:
    """log p_now - log p_sampled of `agent`'s completion tokens, summed, scored on the rows the
    trainer builds from its calls (a multi-turn conversation is one request, not one per turn)."""
    rows, _ = build_rows([c for c in calls if c.agent_name == agent], rollout_id=rollout_id)
    delta = 0.0
    for row in rows:
        assert row.behaviour_logprobs is not None and row.policy, (rollout_id, row.policy)
        now = served_logprobs(server_url, row.policy, row.input_ids)
        if any(value is None and trained for value, trained in zip(now, row.loss_mask)):
            # the cache held a trained token (another rollout's identical turn): compute it all
            now = served_logprobs(server_url, row.policy, row.input_ids, read_cache=False)
        delta += sum(a - b for a, b, trained in zip(now, row.behaviour_logprobs, row.loss_mask)  # type: ignore[operator]
                     if trained)
    return delta
