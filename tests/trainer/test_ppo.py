"""PPO's critic math against verl's core_algos (GAE with observation tokens masked, the value loss,
KL in the reward) to 1e-6, on rollouts split into rows (prefix breaks, two agents), one-token
rollouts and uneven lengths; then the torch engine's PPO step: exact across micro-batches,
the critic learns and is saved/resumed, its warm-up leaves the policy alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_middleware.rows import Row
from trainer_backend.algorithms.advantages import CriticConfig, gae, rollout_advantages_and_returns
from trainer_backend.algorithms.losses import LossConfig, kl_estimate, loss_weights, value_loss

TOL = 1e-6


@pytest.fixture(scope="module")
def verl():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


def _trajectories(seed: int, lengths: list[int], T: int = 12):
    """verl's view: one padded "response" per rollout with observation tokens (mask 0) inside,
    random values at every position, the reward at the last response token."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = torch.zeros(B, T)
    for b, n in enumerate(lengths):
        mask[b, :n] = (torch.rand(n, generator=g) > 0.3).float()
        mask[b, n - 1] = 1.0  # a trajectory ends on an action token
    values = torch.randn(B, T, generator=g)
    rewards = torch.randint(0, 3, (B,), generator=g).float() / 2
    kl = torch.rand(B, T, generator=g) * 0.2
    return mask, values, rewards, kl


def _split(mask_row: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """The response positions of one trajectory, cut into `pieces` consecutive rows."""
    pos = mask_row.nonzero().squeeze(-1)
    return list(torch.tensor_split(pos, pieces)) if pieces > 1 else [pos]


CASES = [(0, [12, 7, 3, 1], [1, 2, 1, 1]), (1, [5, 12, 12], [3, 1, 2]), (2, [1, 1, 9], [1, 1, 4])]


@pytest.mark.parametrize(("seed", "lengths", "pieces"), CASES)
@pytest.mark.parametrize(("gamma", "lam", "kl_coef"), [(1.0, 1.0, 0.0), (0.99, 0.95, 0.0), (0.9, 0.8, 0.1)])
def test_rollout_gae_matches_verl_with_observation_tokens_masked(verl, seed, lengths, pieces, gamma, lam, kl_coef):
    mask, values, rewards, kl = _trajectories(seed, lengths)
    token_rewards = torch.zeros_like(values)
    for b, n in enumerate(lengths):
        token_rewards[b, n - 1] = rewards[b]
    token_rewards = token_rewards - kl_coef * kl * mask  # verl's apply_kl_penalty
    ref_adv, ref_ret = verl.compute_gae_advantage_return(token_rewards, values, mask, torch.tensor(gamma),
                                                         torch.tensor(lam))
    rollout_of, row_values, row_kl, where = [], [], [], []
    for b in range(len(lengths)):
        for pos in _split(mask[b], pieces[b]):
            rollout_of.append(f"r{b}")
            row_values.append(values[b, pos])
            row_kl.append(kl[b, pos])
            where.append((b, pos))
    adv, ret = rollout_advantages_and_returns(rollout_of, {f"r{b}": float(r) for b, r in enumerate(rewards)},
                                              row_values, row_kl, kl_coef=kl_coef, gamma=gamma, lam=lam)
    for (b, pos), a, g in zip(where, adv, ret):
        assert torch.allclose(a, ref_adv[b, pos], atol=TOL, rtol=0)
        assert torch.allclose(g, ref_ret[b, pos], atol=TOL, rtol=0)


def test_gae_by_hand():
    # gamma = lam = 1: A_t = R - V_t, returns = R everywhere
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.2, 0.5, 0.9]))
    assert torch.allclose(adv, torch.tensor([0.8, 0.5, 0.1])) and torch.allclose(ret, torch.ones(3))
    adv, _ = gae(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), gamma=0.5, lam=1.0)
    assert torch.allclose(adv, torch.tensor([0.5, 1.0]))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [0.5, 0.05])
def test_value_loss_matches_verl(verl, seed, clip):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 9
    vpreds = torch.randn(B, T, generator=g).requires_grad_(True)
    old = vpreds.detach() + torch.randn(B, T, generator=g) * 0.3
    returns = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    ref, ref_clipfrac = verl.compute_value_loss(vpreds, returns, old, mask, clip, "token-mean")
    ref_grad, = torch.autograd.grad(ref, vpreds)
    weights = torch.stack(loss_weights(list(mask), [str(i) for i in range(B)], "token-mean"))
    ours, sums = value_loss(vpreds, old, returns, weights, clip)
    grad, = torch.autograd.grad(ours, vpreds)
    assert ours.item() == pytest.approx(ref.item(), abs=TOL)
    assert torch.allclose(grad, ref_grad, atol=TOL, rtol=0)
    assert (sums["vf_clipped_tokens"] / sums["tokens"]).item() == pytest.approx(float(ref_clipfrac), abs=TOL)


def test_kl_in_reward_uses_verl_estimators(verl):
    g = torch.Generator().manual_seed(5)
    old, ref = -torch.rand(3, 4, generator=g) * 3, -torch.rand(3, 4, generator=g) * 3
    for kind in ("k1", "k2", "k3"):
        assert torch.allclose(kl_estimate(old, ref, kind), verl.kl_penalty(old, ref, kind), atol=TOL, rtol=0)


# ---------------------------------------------------------------- the engine's PPO step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.trainer.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("ppo") / "m", vocab=64, hidden=32, layers=2)


def _rows() -> list[Row]:
    """Rollout a in two rows (a prefix break), b in one, c a single row with an observation in it."""
    def row(rid: str, task: str, ids: list[int], mask: list[int], reward: float) -> Row:
        return Row(rollout_id=rid, task_id=task, agent=None, input_ids=tuple(ids), loss_mask=tuple(mask),
                   behaviour_logprobs=None, reward=reward)
    return [row("a", "t", [1, 2, 3, 4, 5], [0, 0, 1, 1, 1], 1.0), row("a", "t", [6, 7, 8, 9], [0, 0, 1, 1], 1.0),
            row("b", "t", [1, 2, 10, 11, 12, 13], [0, 0, 1, 1, 1, 1], 0.0),
            row("c", "u", [3, 4, 20, 21, 22, 23, 24], [0, 0, 1, 0, 0, 1, 1], 0.5)]


def _engine(model_dir: Path, **kw):
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    torch.manual_seed(0)  # the value head's initialisation
    critic = kw.pop("critic", CriticConfig(lr=1e-3))
    cfg = TorchEngineConfig(lr=1e-3, precision="fp32", old_logprobs="recompute", critic=critic, **kw)
    return TorchEngine(model_dir, cfg)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_ppo_step_is_exact_across_micro_batches(model_dir):
    one, three = _engine(model_dir), _engine(model_dir, micro_batch_tokens=8)
    m1, m3 = one.step(_rows()), three.step(_rows())
    assert m3["micro_batches"] >= 3 and m1["micro_batches"] == 1
    for k in ("loss", "vf_loss", "grad_norm", "critic_grad_norm"):
        assert m1[k] == pytest.approx(m3[k], rel=1e-4, abs=1e-6), k
    for a, b in ((one.model, three.model), (one.critic.model, three.critic.model)):
        pa, pb = _params(a), _params(b)
        assert all(torch.allclose(pa[k], pb[k], atol=1e-5) for k in pa)  # 1% of an lr-1e-3 Adam step


def test_the_critic_learns_the_returns(model_dir):
    engine = _engine(model_dir, critic=CriticConfig(lr=3e-3, cliprange_value=10.0))
    errors = [engine.step(_rows())["vf_loss"] for _ in range(8)]
    assert errors[-1] < 0.3 * errors[0], errors  # measured: 0.185 -> 0.031


def test_critic_warmup_leaves_the_policy_and_resume_keeps_the_critic(model_dir, tmp_path):
    engine = _engine(model_dir, critic=CriticConfig(lr=1e-3, warmup_steps=1))
    policy0, critic0 = _params(engine.model), _params(engine.critic.model)
    engine.step(_rows())
    assert all(torch.equal(policy0[k], v) for k, v in _params(engine.model).items())  # warm-up: critic only
    assert any(not torch.equal(critic0[k], v) for k, v in _params(engine.critic.model).items())
    engine.step(_rows())
    assert any(not torch.equal(policy0[k], v) for k, v in _params(engine.model).items())
    ckpt = engine.save(tmp_path / "v2")
    assert (ckpt / "critic" / "config.json").is_file()
    resumed = _engine(ckpt, critic=CriticConfig(lr=1e-3, warmup_steps=1))
    assert resumed.critic.resumed and resumed.critic.steps == 2
    saved, loaded = _params(engine.critic.model), _params(resumed.critic.model)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert resumed.critic.optimizer.state_dict()["state"].keys() == engine.critic.optimizer.state_dict()["state"].keys()


def test_ppo_needs_rewards_on_the_rows(model_dir):
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match="no reward"):
        engine.step([replace(r, reward=None) for r in _rows()])


def test_kl_in_the_reward_lowers_scores_and_reestimates_outcome_advantages(model_dir):
    """GRPO with a KL reward: the score is R - coef * sum KL(old || ref); a policy equal to its
    reference has KL 0 and keeps GRPO's advantages, a moved one gets different ones."""
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    loss = LossConfig(kl_in_reward_coef=0.5, kl_kind="k1")
    engine = TorchEngine(model_dir, TorchEngineConfig(lr=5e-2, precision="fp32", old_logprobs="recompute", loss=loss))
    rows = [r for r in _rows() if r.task_id == "t"]
    first = engine.step(rows)
    assert first["kl_in_reward"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference
    second = engine.step(rows)
    assert abs(second["kl_in_reward"]) > 1e-4
