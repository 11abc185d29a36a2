"""End to end on CPU: rollouts through a wrapped client against the real vLLM server, the daemon
trains a step and swaps the weights in, and the server's logprobs move the way the update pushed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest

from lightning_middleware import TraceStore, rollout, wrap
from trainer_backend.serving.publisher import WeightPublisher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _completion_logprob(server_url: str, prompt: tuple[int, ...], completion: tuple[int, ...]) -> float:
    """Sum of log p(completion | prompt) under the weights the server holds now."""
    body = {"model": "tiny", "prompt": list(prompt + completion), "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0}
    out = httpx.post(f"{server_url}/v1/completions", json=body, timeout=120).json()
    per_position = out["choices"][0]["prompt_logprobs"]
    total = 0.0
    for pos, token in enumerate(completion, start=len(prompt)):
        total += per_position[pos][str(token)]["logprob"]
    return total


def test_daemon_trains_publishes_and_the_server_moves(vllm_server, tied_checkpoints, tmp_path) -> None:
    pytest.importorskip("torch")
    from trainer_backend.daemon.config import GroupPolicy, TrainerConfig
    from trainer_backend.daemon.trainer_daemon import TrainerDaemon
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    base = Path(shutil.copytree(tied_checkpoints.base, tmp_path / "base"))
    publisher = WeightPublisher(vllm_server.url)
    publisher.publish(base, 0)  # other tests swap this shared server: start from known weights
    store = TraceStore(f"sqlite:///{tmp_path / 'e2e.db'}")
    client = wrap(openai.OpenAI(base_url=vllm_server.base_url, api_key="-"), store=store)

    def run_rollouts(tag: str) -> None:
        version = int(publisher.weight_version())
        for task in ("alpha", "beta"):
            for i in range(4):
                with rollout(f"{tag}-{task}", store=store, policy_version=version) as r:
                    msgs = [{"role": "user", "content": f"say something about {task}"}]
                    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                                           temperature=1.0, seed=i)
                    msgs += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                             {"role": "user", "content": "and more"}]
                    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=1.0,
                                                   seed=10 + i)
                    r.reward(float(i % 2))  # two good, two bad samples per task

    run_rollouts("before")
    trained = store.query_rollouts(status="succeeded")
    calls = store.calls_for([r.id for r in trained], training_only=True)
    assert all(len(calls[r.id]) == 2 and all(c.logprobs for c in calls[r.id]) for r in trained)
    assert all(c.policy_version == 0 for cs in calls.values() for c in cs)

    engine = TorchEngine(base, TorchEngineConfig(lr=3e-3), policy_version=0)
    daemon = TrainerDaemon(store, engine, TrainerConfig(checkpoint_dir=str(tmp_path / "ckpt"),
                                                        group=GroupPolicy(group_size=4, groups_per_step=2)),
                           publisher=publisher)
    good = next(r for r in trained if r.final_reward == 1.0)
    bad = next(r for r in trained if r.final_reward == 0.0)
    probe = {r.id: (calls[r.id][0].prompt_token_ids, calls[r.id][0].completion_token_ids) for r in (good, bad)}
    before = {rid: _completion_logprob(vllm_server.url, *pc) for rid, pc in probe.items()}
    # The server's logprobs at v0 are the behaviour logprobs the call recorded.
    assert before[good.id] == pytest.approx(sum(calls[good.id][0].logprobs), abs=1e-3)

    [result] = daemon.run(max_steps=1)
    assert result.policy_version == 1 and result.metrics["publish_verified"] is True
    assert store.query_rollouts(consumed=False) == []
    assert publisher.weight_version() == "1"
    # the breakdown splits the real publish: its pause call (the drain) and the rest
    from lightning_middleware import analysis as A

    [row] = A.step_breakdown(store).itertuples()
    m = result.metrics
    assert row.drain_s == m["publish_engine_pause_s"] > 0  # no gateway here
    assert row.drain_s + row.publish_s == pytest.approx(m["publish_total_s"]) and row.publish_s > 0

    after = {rid: _completion_logprob(vllm_server.url, *pc) for rid, pc in probe.items()}
    assert after[good.id] > before[good.id]  # positive advantage: made more likely
    assert after[bad.id] < before[bad.id]  # negative advantage: made less likely

    daemon.close()
    run_rollouts("after")
    new = store.query_rollouts(consumed=False)
    new_calls = store.calls_for([r.id for r in new], training_only=True)
    assert {r.policy_version for r in new} == {1}
    assert {c.policy_version for cs in new_calls.values() for c in cs} == {1}
    store.close()  # its writer and WAL-checkpoint threads end with it (the suite lists threads left running)
