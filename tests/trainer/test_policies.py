"""A set of LoRA policies on one base: each trains on its own rows with its own optimizer, the
others stay as they were, checkpoints hold an adapter folder per policy and resume exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from lightning_middleware.rows import Row  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.engines.lora import AdapterConfig, adapter_parameters, is_adapter_dir  # noqa: E402
from trainer_backend.engines.policies import PolicySet  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

CONFIG = TorchEngineConfig(lr=1e-2, precision="fp32", old_logprobs="recompute", lora=AdapterConfig(rank=4))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.trainer.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("policies") / "m", vocab=64, hidden=32, layers=2)


def _rows(*policies: str | None) -> list[Row]:
    out = []
    for i, policy in enumerate(policies):
        for k, adv in enumerate((1.0, -1.0)):
            out.append(Row(rollout_id=f"r{i}-{k}", task_id=f"t{i}", agent=policy, policy=policy,
                           input_ids=(1, 2, 3 + i, 4 + k, 5), loss_mask=(0, 0, 1, 1, 1), behaviour_logprobs=None,
                           advantage=adv))
    return out


def _snapshot(policies: PolicySet) -> dict[str, list[torch.Tensor]]:
    model = policies.engines[policies.names[0]].model
    return {n: [p.detach().clone() for p in adapter_parameters(model, n)] for n in policies.names}


def _changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def test_each_policy_trains_on_its_own_rows_only(model_dir):
    torch.manual_seed(0)
    policies = PolicySet(model_dir, ["coder", "reviewer"], CONFIG)
    engines = policies.engines
    assert engines["coder"].model is engines["reviewer"].model  # one base, loaded once
    assert {id(p) for p in engines["coder"].params}.isdisjoint(id(p) for p in engines["reviewer"].params)
    before = _snapshot(policies)
    m = policies.step(_rows("coder", "coder"))
    after = _snapshot(policies)
    assert _changed(before["coder"], after["coder"]) and not _changed(before["reviewer"], after["reviewer"])
    assert m["policies_updated"] == 1 and m["coder/rows"] == 4 and "reviewer/rows" not in m
    assert policies.policy_version == 1 and m["coder/updates"] == 1
    m = policies.step(_rows("coder", "reviewer"))
    assert m["policies_updated"] == 2 and m["rows"] == 4 and m["grad_norm"] == max(m["coder/grad_norm"],
                                                                                   m["reviewer/grad_norm"])
    assert _changed(after["reviewer"], _snapshot(policies)["reviewer"])
    assert m["coder/updates"] == 2 and m["reviewer/updates"] == 1 and policies.policy_version == 2


def test_each_policy_matches_a_lone_engine_trained_on_its_rows(model_dir):
    """Sharing the base changes nothing: a policy's step in the set equals a single-adapter engine's."""
    torch.manual_seed(0)
    policies = PolicySet(model_dir, ["coder", "reviewer"], CONFIG)
    coder_init = [p.detach().clone() for p in policies.engines["coder"].params]
    torch.manual_seed(0)
    lone = TorchEngine(model_dir, CONFIG)
    with torch.no_grad():
        for p, q in zip(lone.params, coder_init):
            p.copy_(q)
    rows = _rows("coder", "reviewer")
    a = policies.step(rows)
    b = lone.step([r for r in rows if r.policy == "coder"])
    assert a["coder/loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["coder/grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(policies.engines["coder"].params, lone.params))


def test_unknown_models_go_to_the_default_or_are_left_out(model_dir):
    policies = PolicySet(model_dir, ["coder", "reviewer"], CONFIG)
    m = policies.step(_rows("coder", "base-model"))
    assert m["rows_unrouted"] == 2 and m["coder/rows"] == 2
    with pytest.raises(ValueError, match="no row belongs"):
        policies.step(_rows("base-model"))
    routed = PolicySet(model_dir, ["coder", "reviewer"], CONFIG, default="reviewer")
    assert routed.step(_rows("base-model"))["reviewer/rows"] == 2
    with pytest.raises(ValueError, match="not one of"):
        PolicySet(model_dir, ["coder"], CONFIG, default="nobody")


def test_a_checkpoint_holds_each_adapter_and_resumes_exactly(model_dir, tmp_path):
    torch.manual_seed(0)
    policies = PolicySet(model_dir, ["coder", "reviewer"], CONFIG)
    policies.step(_rows("coder", "reviewer"))
    ckpt = policies.save(tmp_path / "v000001")
    assert all(is_adapter_dir(ckpt / n) and (ckpt / n / "trainer_state.pt").is_file() for n in ("coder", "reviewer"))
    resumed = PolicySet(ckpt, ["coder", "reviewer"], CONFIG, policy_version=1)
    assert all(e.resumed for e in resumed.engines.values())
    before, again = _snapshot(policies), _snapshot(resumed)
    assert all(torch.equal(a, b) for n in before for a, b in zip(before[n], again[n]))
    x, y = policies.step(_rows("coder", "reviewer")), resumed.step(_rows("coder", "reviewer"))
    assert x["coder/grad_norm"] == pytest.approx(y["coder/grad_norm"], rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for n in before
               for a, b in zip(_snapshot(policies)[n], _snapshot(resumed)[n]))


def test_the_reference_is_the_base_for_every_policy(model_dir):
    policies = PolicySet(model_dir, ["coder", "reviewer"], TorchEngineConfig(
        lr=5e-2, precision="fp32", old_logprobs="recompute", lora=AdapterConfig(rank=4), loss=LossConfig(kl_coef=0.1)))
    for _ in range(3):
        m = policies.step(_rows("coder", "reviewer"))
    assert m["coder/kl_ref"] > 0 and m["reviewer/kl_ref"] > 0


def test_the_daemon_trains_each_policy_on_its_agents_rewards(llm_server, store, tmp_path):
    """Rollouts of a two-agent team through wrap(policies=...): the team's reward is the same in
    every rollout (a group that would carry no signal for one policy), the roles' own rewards
    differ. The daemon trains both adapters, each with its role's reward, one version for both."""
    import openai

    from lightning_middleware import agent_scope, emit_reward, rollout, wrap
    from tests.trainer.tiny_models import save_tiny_qwen2
    from trainer_backend.daemon.config import GroupPolicy, TrainerConfig
    from trainer_backend.daemon.trainer_daemon import TrainerDaemon

    base = save_tiny_qwen2(tmp_path / "bytes", vocab=260, hidden=32, layers=1, max_positions=1024)
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store,
                  policies={"coder": "coder", "reviewer": "reviewer"})
    for task in ("t1", "t2"):
        for i in range(4):
            with rollout(task, store=store) as r:
                for agent in ("coder", "reviewer"):
                    with agent_scope(agent):
                        client.chat.completions.create(model="m", max_tokens=8,
                                                       messages=[{"role": "user", "content": f"{agent} {task} {i}"}])
                emit_reward(float(i % 2), agent="coder")
                emit_reward(float(i < 2), agent="reviewer")
                r.reward(1.0)  # the team's reward: uniform
    torch.manual_seed(0)
    with TrainerDaemon(store, PolicySet(base, ["coder", "reviewer"], CONFIG),
                       TrainerConfig(checkpoint_dir=str(tmp_path / "ckpt"), poll_interval_s=0.05,
                                     group=GroupPolicy(group_size=4, groups_per_step=2))) as daemon:
        [result] = daemon.run(max_steps=1)  # closed after: its lease thread ends with the test
    m = result.metrics
    assert m.get("skipped_uniform_reward", 0) == 0  # the roles' rewards differ: signal
    assert m["policies_updated"] == 2 and m["coder/rows"] == 8 and m["reviewer/rows"] == 8
    assert m["adv_abs_mean"] > 0.5  # the team's uniform reward alone would give every row advantage 0
    assert result.policy_version == 1
    ckpt = Path(store.get_policy_version(1).path)
    assert is_adapter_dir(ckpt / "coder") and is_adapter_dir(ckpt / "reviewer")
