"""The algorithms behind `--algo`, checked against verl's core_algos to 1e-6 (and by hand), on
the branching cases the GRPO tests use: groups of several sizes, ties, a rollout split in rows
(a prefix break), two agents, retries (rows of the same rollout), groups of one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_middleware.records import Rollout
from lightning_middleware.rows import Row
from trainer_backend.algorithms.advantages import advantages_for, estimate, group_centre, whiten_by_tokens
from trainer_backend.algorithms.losses import LossConfig, kl_estimate, loss_weights, policy_loss, sequence_log_ratio

TOL = 1e-6


@pytest.fixture(scope="module")
def verl():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


def _batch(seed: int, sizes: tuple[int, ...], T: int = 6):
    """Per-sample scores, group ids (interleaved), a response mask and token-level rewards as verl takes them."""
    g = torch.Generator().manual_seed(seed)
    groups = [k for k, n in enumerate(sizes) for _ in range(n)]
    order = torch.randperm(len(groups), generator=g).tolist()
    groups = [groups[i] for i in order]
    scores = torch.randint(0, 3, (len(groups),), generator=g).float() / 2  # ties happen
    mask = torch.ones(len(groups), T)
    lengths = torch.randint(1, T + 1, (len(groups),), generator=g)
    for i, n in enumerate(lengths):
        mask[i, n:] = 0
    token_rewards = torch.zeros(len(groups), T)
    token_rewards[torch.arange(len(groups)), lengths - 1] = scores
    return scores, groups, mask, token_rewards


CASES = [(0, (4, 4, 4)), (1, (2, 3, 5)), (2, (8, 8)), (3, (3, 3, 3, 3, 2))]


@pytest.mark.parametrize(("seed", "sizes"), CASES)
def test_rloo_matches_verl(verl, seed, sizes):
    scores, groups, mask, token_rewards = _batch(seed, sizes)
    ref, _ = verl.compute_rloo_outcome_advantage(token_rewards, mask, np.array(groups))
    ours = estimate("rloo", scores, groups, mask.sum(-1))
    assert torch.allclose(ours.unsqueeze(-1) * mask, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize(("seed", "sizes"), CASES)
def test_reinforce_pp_matches_verl(verl, seed, sizes):
    scores, groups, mask, token_rewards = _batch(seed, sizes)
    ref, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(token_rewards, mask, np.array(groups))
    ours = estimate("reinforce_pp", scores, groups, mask.sum(-1))
    assert torch.allclose(ours.unsqueeze(-1) * mask, ref, atol=TOL, rtol=0)


def test_groups_of_one_get_no_advantage_where_verl_gives_the_reward(verl):
    scores, groups = torch.tensor([0.7, 1.0, 0.0]), [0, 1, 1]
    mask = torch.ones(3, 2)
    token_rewards = torch.zeros(3, 2)
    token_rewards[:, -1] = scores
    ref, _ = verl.compute_rloo_outcome_advantage(token_rewards, mask, np.array(groups))
    assert ref[0, 0] == pytest.approx(0.7)  # verl: no baseline for a group of one, A = R
    for algo in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        assert estimate(algo, scores, groups, mask.sum(-1))[0] == 0.0, algo  # ours: no signal


def test_advantages_by_hand():
    s, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), [0, 0, 0, 0]
    assert group_centre(s, groups, leave_one_out=True).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert estimate("dr_grpo", s, groups, torch.ones(4)).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # whitening weighs each sample by its tokens: a 3-token sample moves the mean 3 times as much
    w = whiten_by_tokens(torch.tensor([1.0, -1.0]), torch.tensor([3.0, 1.0]))
    mean, var = 0.5, (3 * 0.25 + 2.25) / 4 * 4 / 3
    assert w.tolist() == pytest.approx([(1 - mean) / var ** 0.5, (-1 - mean) / var ** 0.5], abs=1e-5)
    with pytest.raises(ValueError, match="unknown algorithm"):
        estimate("ppo2", s, groups, torch.ones(4))


def _row(rid: str, task: str, n_resp: int, agent: str | None = None) -> Row:
    return Row(rollout_id=rid, task_id=task, agent=agent, input_ids=(1,) * (n_resp + 1),
               loss_mask=(0,) + (1,) * n_resp, behaviour_logprobs=None)


def test_rollout_level_gives_every_row_of_a_rollout_its_advantage():
    """Rollout a broke its prefix (two rows), rollout c has two agents (two rows): at the rollout
    level each counts once in its group; at the sample level each row counts."""
    rollouts = [Rollout(id=i, task_id=t, final_reward=r)
                for i, t, r in (("a", "t", 1.0), ("b", "t", 0.0), ("c", "t", 0.5), ("d", "u", 1.0), ("e", "u", 0.0))]
    rows = [_row("a", "t", 2), _row("a", "t", 3), _row("b", "t", 4), _row("c", "t", 1, "x"), _row("c", "t", 1, "y"),
            _row("d", "u", 3), _row("e", "u", 2)]
    for algo in ("grpo", "rloo", "reinforce_pp"):
        per_row = advantages_for(algo, rollouts, rows)
        assert per_row[0] == per_row[1] and per_row[3] == per_row[4], algo
        per_rollout = estimate(algo, torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0]), ["t", "t", "t", "u", "u"],
                               torch.tensor([5.0, 4.0, 2.0, 3.0, 2.0]))
        assert per_row[0] == pytest.approx(float(per_rollout[0]), abs=TOL), algo
        sample = advantages_for(algo, rollouts, rows, level="sample")
        assert sample != per_row, algo  # a rollout split in two rows weighs twice at the sample level
    assert advantages_for("rloo", rollouts, rows)[2] == pytest.approx(0.0 - 0.75)  # b minus the mean of a and c
    with pytest.raises(ValueError, match="advantage level"):
        advantages_for("grpo", rollouts, rows, level="token")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4)])
def test_gspo_loss_matches_verl(verl, seed, clip_low, clip_high):
    from verl.workers.config import ActorConfig

    g = torch.Generator().manual_seed(seed)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    adv = (torch.randn(B, generator=g) * 2).unsqueeze(-1).expand(B, T)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[3] = 0
    actor = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                        ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    ref, metrics = verl.compute_policy_loss_gspo(old, logp, adv, mask, "seq-mean-token-mean", actor)
    ref_grad, = torch.autograd.grad(ref, logp)
    cfg = LossConfig(agg="seq-mean-token-mean", clip_low=clip_low, clip_high=clip_high, ratio_level="sequence")
    weights = torch.stack(loss_weights(list(mask), [str(i) for i in range(B)], cfg.agg))
    ours, sums = policy_loss(logp, old, adv, weights, cfg)
    grad, = torch.autograd.grad(ours, logp)
    assert ours.item() == pytest.approx(ref.item(), abs=TOL)
    assert torch.allclose(grad, ref_grad, atol=TOL, rtol=0)  # the gradient too (the stop-gradient trick)
    n = sums["response_tokens"]
    assert (sums["clipped_tokens"] / n).item() == pytest.approx(metrics["actor/pg_clipfrac"], abs=TOL)
    assert (sums["neg_log_ratio_sum"] / n).item() == pytest.approx(metrics["actor/ppo_kl"], abs=TOL)


def test_gspo_ratio_is_the_geometric_mean_per_row():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not a response token
    ratio = sequence_log_ratio(logp, old, mask).exp()
    assert torch.allclose(ratio, torch.full((1, 3), float(np.exp(0.25))))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_verl(verl, kind):
    g = torch.Generator().manual_seed(3)
    logp, ref = -torch.rand(4, 6, generator=g) * 4, -torch.rand(4, 6, generator=g) * 4
    assert torch.allclose(kl_estimate(logp, ref, kind), verl.kl_penalty(logp, ref, kind), atol=TOL, rtol=0)


def test_micro_batches_add_up_for_every_algorithm_loss():
    """Rollout-level weighting is exact across micro-batches for token and sequence ratios alike."""
    g = torch.Generator().manual_seed(7)
    B, T = 6, 8
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g) * 0.4
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    rollout_ids = ["a", "a", "b", "c", "c", "c"]
    for cfg in (LossConfig(), LossConfig(ratio_level="sequence", agg="seq-mean-token-mean"),
                LossConfig(ratio_level="sequence"), LossConfig(kl_coef=0.1, kl_kind="k2")):
        weights = torch.stack(loss_weights(list(mask), rollout_ids, cfg.agg))
        ref_logp = old - 0.1
        full, _ = policy_loss(logp, old, adv, weights, cfg, ref_logp=ref_logp)
        parts = sum(policy_loss(logp[i], old[i], adv[i], weights[i], cfg, ref_logp=ref_logp[i])[0]
                    for i in ([0, 1], [2, 3], [4, 5]))
        assert float(parts) == pytest.approx(float(full), abs=TOL), cfg


def test_truncated_importance_sampling_weights_each_token_by_the_capped_ratio():
    """TIS: the ratio is against the current policy (1 before the update) and each token's loss
    is weighted by min(pi_current / pi_behaviour, C), detached."""
    logp = torch.tensor([[-1.0, -1.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -3.0, -1.0]])  # ratios 1, e^2 (capped at 2), e^-1
    adv = torch.ones(1, 3)
    weights = torch.full((1, 3), 1 / 3)
    cfg = LossConfig(agg="token-mean", tis_threshold=2.0)
    loss, sums = policy_loss(logp, logp.detach(), adv, weights, cfg, behaviour_logp=behaviour)
    w = torch.tensor([1.0, 2.0, float(np.exp(-1.0))])
    assert loss.item() == pytest.approx(-(w.sum() / 3).item(), abs=TOL)  # ratio 1: -A * w, averaged
    grad, = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -w.unsqueeze(0) / 3, atol=TOL)  # d/dlogp of -A * w * e^(logp - sg(logp))
    assert sums["tis_truncated_tokens"].item() == 1 and sums["tis_weight_sum"].item() == pytest.approx(w.sum().item())
    with pytest.raises(ValueError, match="behaviour_logp"):
        policy_loss(logp, logp.detach(), adv, weights, cfg)


def test_one_table_names_every_algorithm_and_what_it_means() -> None:
    """`--algo` is a key in `registry.TABLE`: the settings accept exactly its names, every outcome
    algorithm has its estimator and no other does, and an unknown name is one clear error."""
    import typing

    from trainer_backend.algorithms import registry
    from trainer_backend.algorithms.advantages import ESTIMATORS
    from trainer_backend.daemon.settings import AlgorithmSettings, TrainerSettings

    assert typing.get_args(AlgorithmSettings.model_fields["name"].annotation) == registry.ALGORITHMS
    assert sorted(ESTIMATORS) == sorted(registry.OUTCOME)
    assert [n for n in registry.ALGORITHMS if registry.trains_uniform_groups(n)] == ["ppo"]
    assert "dpo" not in registry.PER_TURN_ALGORITHMS and "ppo" in registry.PER_TURN_ALGORITHMS
    with pytest.raises(ValueError, match="unknown algorithm 'ppo2'; one of grpo, "):
        registry.get("ppo2")
    gspo = TrainerSettings.load(None, {"algorithm.name": "gspo"}).loss_config()
    assert (gspo.ratio_level, gspo.agg) == ("sequence", "seq-mean-token-mean")
    grpo = TrainerSettings.load(None, {"algorithm.name": "grpo"}).loss_config()
    assert (grpo.ratio_level, grpo.agg) == ("token", "rollout-token-mean")
