"""GRPO math: hand calculations, verl's core_algos as reference, micro-batch exactness."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch

from lightning_middleware.rows import Row
from trainer_backend.algorithms.advantages import group_normalize, rollout_advantages, sample_advantages
from trainer_backend.algorithms.logprobs import entropy_from_logits, token_logprobs, token_logprobs_entropy
from trainer_backend.algorithms.losses import (
    LossConfig,
    agg_loss,
    kl_estimate,
    loss_weights,
    policy_loss,
    ppo_token_loss,
)

TOL = 1e-6


@pytest.fixture(scope="module")
def verl():
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    vF = pytest.importorskip("verl.utils.torch_functional")
    return core, vF


def _row(rid: str, task: str, n_resp: int) -> Row:
    return Row(rollout_id=rid, task_id=task, agent=None, input_ids=(1,) * (n_resp + 1),
               loss_mask=(0,) + (1,) * n_resp, behaviour_logprobs=None)


# ---------------------------------------------------------------- advantages by hand


def test_rollout_advantage_by_hand():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "solo": 1.0, "e": 0.5, "f": 0.5}
    tasks = {"a": "t", "b": "t", "c": "t", "d": "t", "solo": "s", "e": "u", "f": "u"}
    adv = rollout_advantages(rewards, tasks)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv["a"] == pytest.approx(0.5 / (std + 1e-6), abs=TOL)
    assert adv["b"] == pytest.approx(-0.5 / (std + 1e-6), abs=TOL)
    assert adv["solo"] == 0.0  # group of one
    assert adv["e"] == adv["f"] == 0.0  # ties
    no_std = rollout_advantages(rewards, tasks, norm_by_std=False)
    assert no_std["a"] == pytest.approx(0.5) and no_std["c"] == pytest.approx(-0.5)


def test_sample_level_counts_each_row():
    rows = [_row("a", "t", 2), _row("a", "t", 3), _row("b", "t", 1)]  # rollout a has two rows
    adv = sample_advantages(rows, {"a": 1.0, "b": 0.0})
    mean, std = 2 / 3, float(torch.tensor([1.0, 1.0, 0.0]).std())
    assert adv == pytest.approx([(1 - mean) / (std + 1e-6)] * 2 + [(0 - mean) / (std + 1e-6)], abs=TOL)
    roll = rollout_advantages({"a": 1.0, "b": 0.0}, {"a": "t", "b": "t"})
    assert roll["a"] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), abs=TOL)  # differs from sample-level


# ---------------------------------------------------------------- advantages vs verl


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("case", ["binary", "continuous", "ties", "mixed_sizes"])
def test_group_normalize_matches_verl(verl, norm_by_std, case):
    core, _ = verl
    g = torch.Generator().manual_seed(["binary", "continuous", "ties", "mixed_sizes"].index(case))
    if case == "binary":
        groups = [i // 8 for i in range(32)]
        scores = torch.randint(0, 2, (32,), generator=g).float()
    elif case == "continuous":
        groups = [i // 4 for i in range(24)]
        scores = torch.randn(24, generator=g) * 3
    elif case == "ties":
        groups = [0, 0, 0, 1, 1, 2, 2, 2]
        scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.2, 0.7, 0.2])
    else:
        groups = [0, 1, 0, 2, 2, 1, 0, 2, 2, 1]  # interleaved, sizes 3/3/4
        scores = torch.randn(10, generator=g)
    T = 5
    mask = torch.ones(len(scores), T)
    lengths = torch.randint(1, T + 1, (len(scores),), generator=g)
    for i, n in enumerate(lengths):
        mask[i, n:] = 0
    token_rewards = torch.zeros(len(scores), T)
    token_rewards[torch.arange(len(scores)), lengths - 1] = scores
    ref, _ = core.compute_grpo_outcome_advantage(token_rewards, mask, np.array(groups),
                                                 norm_adv_by_std_in_grpo=norm_by_std)
    ours = group_normalize(scores, groups, norm_by_std=norm_by_std)
    assert torch.allclose(ours.unsqueeze(-1) * mask, ref, atol=TOL, rtol=0)


def test_group_of_one_differs_from_verl_as_documented(verl):
    core, _ = verl
    ref, _ = core.compute_grpo_outcome_advantage(torch.tensor([[0.0, 0.7]]), torch.ones(1, 2), np.array([0]))
    assert ref[0, 0] == pytest.approx(0.7 / (1 + 1e-6))  # verl: mean 0, std 1
    assert group_normalize(torch.tensor([0.7]), [0]).item() == 0.0  # ours: no baseline, no signal


# ---------------------------------------------------------------- aggregation


def _random_batch(seed: int, B: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[1] = 0  # a fully masked row
    return loss_mat, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agg_loss_matches_verl(verl, mode, seed):
    core, _ = verl
    loss_mat, mask = _random_batch(seed)
    ref = core.agg_loss(loss_mat, mask, mode)
    assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(ref.item(), abs=TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollout_token_mean_is_verl_seq_mean_over_concatenated_rollouts(verl, seed):
    core, _ = verl
    loss_mat, mask = _random_batch(seed)
    rollout_ids = ["a", "a", "b", "c", "c", "c"]
    ours = agg_loss(loss_mat, mask, "rollout-token-mean", rollout_ids)
    concat_loss, concat_mask = [], []
    for rid in ["a", "b", "c"]:
        idx = [i for i, r in enumerate(rollout_ids) if r == rid]
        concat_loss.append(loss_mat[idx].reshape(-1))
        concat_mask.append(mask[idx].reshape(-1))
    width = max(len(x) for x in concat_loss)
    L = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in concat_loss])
    M = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in concat_mask])
    ref = core.agg_loss(L, M, "seq-mean-token-mean")
    assert ours.item() == pytest.approx(ref.item(), abs=TOL)


def test_rollout_token_mean_by_hand():
    # rollout a: rows with 1 and 3 tokens (losses 1 | 2 2 2); rollout b: 1 token (loss 10)
    loss = torch.tensor([[1.0, 0, 0], [2, 2, 2], [10, 0, 0]])
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1], [1, 0, 0]])
    ids = ["a", "a", "b"]
    assert agg_loss(loss, mask, "rollout-token-mean", ids).item() == pytest.approx(((1 + 6) / 4 + 10) / 2)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(17 / 5)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 2 + 10) / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(17 / 3)
    with pytest.raises(ValueError):
        agg_loss(loss, mask, "rollout-token-mean")
    with pytest.raises(ValueError):
        agg_loss(loss, mask, "bogus")


def test_weights_all_masked_are_zero():
    w = loss_weights([torch.zeros(3)], ["a"], "rollout-token-mean")
    assert torch.equal(w[0], torch.zeros(3))


# ---------------------------------------------------------------- PPO loss


def test_ppo_token_loss_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))  # ratios
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    t = ppo_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 (clipped); A<0, r=1.5: max(1.5, 1.2) = 1.5
    # A>0, r=0.5: max(-0.5, -0.8) = -0.5;             A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    assert t.pg_loss.tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8])
    assert t.clipped.tolist() == [True, False, False, True]
    dual = ppo_token_loss(torch.log(torch.tensor([5.0])), torch.zeros(1), torch.tensor([-1.0]), dual_clip_c=3.0)
    assert dual.pg_loss.item() == pytest.approx(3.0) and dual.clipped_lower.item()
    with pytest.raises(ValueError):
        ppo_token_loss(old, old, adv, dual_clip_c=1.0)


CLIP_CASES = [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0), (0.2, 0.2, 3.0), (0.2, 0.2, 1.5)]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("clip_low,clip_high,dual", CLIP_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_matches_verl(verl, mode, clip_low, clip_high, dual, seed):
    core, _ = verl
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 9
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g) * 0.6  # ratios well outside the clip range
    adv = (torch.randn(B, generator=g) * 2).unsqueeze(-1).expand(B, T)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[2] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_loss, ref_clipfrac, ref_kl, ref_clip_lower = core.compute_policy_loss(
            old, logp, adv, mask, cliprange=None, cliprange_low=clip_low, cliprange_high=clip_high,
            clip_ratio_c=dual if dual is not None else 1e9, loss_agg_mode=mode)
    cfg = LossConfig(agg=mode, clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual)
    weights = torch.stack(loss_weights(list(mask), [str(i) for i in range(B)], mode))
    loss, sums = policy_loss(logp, old, adv, weights, cfg)
    n = sums["response_tokens"]
    assert loss.item() == pytest.approx(ref_loss.item(), abs=TOL)
    assert (sums["clipped_tokens"] / n).item() == pytest.approx(ref_clipfrac.item(), abs=TOL)
    assert (sums["neg_log_ratio_sum"] / n).item() == pytest.approx(ref_kl.item(), abs=TOL)
    assert (sums["clipped_lower_tokens"] / n).item() == pytest.approx(ref_clip_lower.item(), abs=TOL)
    assert sums["log_ratio_max"].item() == pytest.approx((logp - old)[mask.bool()].max().item(), abs=TOL)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_matches_verl(verl, kind):
    core, _ = verl
    g = torch.Generator().manual_seed(3)
    logp, ref = -torch.rand(4, 6, generator=g) * 4, -torch.rand(4, 6, generator=g) * 4
    ref_val = core.kl_penalty(logp, ref, kind)
    assert torch.allclose(kl_estimate(logp, ref, kind), ref_val, atol=TOL, rtol=0)
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k9")


def test_entropy_and_logprobs(verl):
    _, vF = verl
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    assert torch.allclose(entropy_from_logits(logits), vF.entropy_from_logits(logits), atol=TOL, rtol=0)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    ref = vF.logprobs_from_logits(logits, targets)
    assert torch.allclose(token_logprobs(logits, targets), ref, atol=TOL, rtol=0)
    uniform = entropy_from_logits(torch.zeros(7))
    assert uniform.item() == pytest.approx(math.log(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 4, 5, 1000])  # 20 positions: single, dividing, ragged, one chunk
@pytest.mark.parametrize("grads", ["both", "logp", "entropy"])
def test_chunked_logprobs_and_entropy_match_autograd(dtype, chunk, grads):
    g = torch.Generator().manual_seed(5)
    z = (torch.randn(4, 5, 13, generator=g) * 4).to(dtype)
    z[0, 0] = 0.0  # uniform row
    z[1, 1, 3] = 60.0  # near one-hot row: p ~ 1, entropy ~ 0
    targets = torch.randint(0, 13, (4, 5), generator=g)
    targets[1, 1] = 3
    g_lp, g_h = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)

    ref_z = z.float().clone().requires_grad_(True)  # the reference: plain autograd in fp32 on the same values
    ref_lp, ref_h = token_logprobs(ref_z, targets), entropy_from_logits(ref_z)
    fz = z.detach().clone().requires_grad_(True)
    lp, h = token_logprobs_entropy(fz, targets, with_entropy=True, chunk=chunk)
    assert lp.dtype == h.dtype == torch.float32 and lp.shape == h.shape == (4, 5)
    # fp32 throughout; entropy as -sum p log p vs logsumexp - sum p z: equal to float rounding
    assert torch.allclose(lp, ref_lp, atol=TOL, rtol=0) and torch.allclose(h, ref_h, atol=1e-5, rtol=0)
    assert h[0, 0].item() == pytest.approx(math.log(13), abs=TOL) and abs(h[1, 1].item()) < 1e-6

    use_lp, use_h = grads in ("both", "logp"), grads in ("both", "entropy")
    ((ref_lp * g_lp).sum() * use_lp + (ref_h * g_h).sum() * use_h).backward()
    (((lp * g_lp).sum() if use_lp else 0) + ((h * g_h).sum() if use_h else 0)).backward()
    assert fz.grad.dtype == dtype
    # bf16 gradients are rounded to bf16 (8 bits of mantissa) once, at the end
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * ref_z.grad.abs().max().item()
    assert torch.allclose(fz.grad.float(), ref_z.grad, atol=tol, rtol=0)


def test_chunked_logprobs_without_entropy_and_bad_shapes():
    z = torch.randn(3, 7, requires_grad=True)
    t = torch.tensor([0, 6, 3])
    lp, h = token_logprobs_entropy(z, t, with_entropy=False, chunk=2)
    assert h is None and torch.allclose(lp, token_logprobs(z, t), atol=TOL, rtol=0)
    lp.sum().backward()
    assert torch.allclose(z.grad.sum(-1), torch.zeros(3), atol=TOL)  # onehot - p sums to 0
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs_entropy(z, torch.tensor([0, 1]))


def test_kl_and_entropy_terms_in_loss():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    ent = torch.tensor([[2.0, 4.0]])
    w = torch.tensor([[0.5, 0.5]])
    cfg = LossConfig(kl_coef=0.1, kl_kind="k1", entropy_coef=0.01)
    loss, sums = policy_loss(logp, logp.detach(), torch.ones(1, 2), w, cfg, ref_logp=ref, entropy=ent)
    # pg = -1 (ratio 1, A 1); kl k1 mean = (0.5 - 1) / 2 = -0.25; entropy mean 3
    assert loss.item() == pytest.approx(-1 + 0.1 * -0.25 - 0.01 * 3)
    assert sums["kl_ref"].item() == pytest.approx(-0.25) and sums["entropy"].item() == pytest.approx(3)
    with pytest.raises(ValueError):
        policy_loss(logp, logp.detach(), torch.ones(1, 2), w, LossConfig(kl_coef=0.1))


# ---------------------------------------------------------------- micro-batch exactness


def _exactness_setup(seed: int):
    """Rows of uneven length from 4 rollouts; per-token log-probs from a shared parameter."""
    g = torch.Generator().manual_seed(seed)
    rollout_ids = ["r0", "r0", "r1", "r2", "r2", "r2", "r3", "r1"]
    lengths = [3, 9, 5, 1, 4, 12, 7, 2]
    vocab = 13
    param = torch.randn(vocab, generator=g, requires_grad=True)
    rows = []
    for n in lengths:
        targets = torch.randint(0, vocab, (n,), generator=g)
        scale = torch.rand(n, generator=g) + 0.5
        mask = (torch.rand(n, generator=g) > 0.2).float()
        old = -torch.rand(n, generator=g) * 3
        rows.append(dict(targets=targets, scale=scale, mask=mask, old=old))
    adv = {"r0": 1.3, "r1": -0.7, "r2": 0.4, "r3": -1.1}
    return param, rows, rollout_ids, adv


def _loss_of(param, rows, rollout_ids, adv, weights, idx, cfg):
    """Pad rows[idx] into one micro-batch and return its loss."""
    T = max(len(rows[i]["targets"]) for i in idx)

    def pad(x):
        return torch.nn.functional.pad(x, (0, T - len(x)))

    logp = torch.stack([pad(torch.log_softmax(param * rows[i]["scale"].unsqueeze(-1), -1)
                            .gather(-1, rows[i]["targets"].unsqueeze(-1)).squeeze(-1)) for i in idx])
    old = torch.stack([pad(rows[i]["old"]) for i in idx])
    a = torch.tensor([adv[rollout_ids[i]] for i in idx]).unsqueeze(-1).expand(len(idx), T)
    w = torch.stack([pad(weights[i]) for i in idx])
    loss, _ = policy_loss(logp, old, a, w, cfg, ref_logp=old - 0.1, entropy=torch.ones_like(logp))
    return loss


SPLITS = {
    "singletons": [[i] for i in range(8)],
    "pairs": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "uneven_shuffled": [[5], [0, 7, 3], [2, 6, 1, 4]],
}


@pytest.mark.parametrize("mode", ["rollout-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("dual", [None, 3.0])
def test_micro_batches_equal_full_batch(mode, split, dual):
    param, rows, rollout_ids, adv = _exactness_setup(seed=7)
    cfg = LossConfig(agg=mode, dual_clip_c=dual, kl_coef=0.05, entropy_coef=0.01)
    weights = loss_weights([r["mask"] for r in rows], rollout_ids, mode)

    full = _loss_of(param, rows, rollout_ids, adv, weights, list(range(8)), cfg)
    (full_grad,) = torch.autograd.grad(full, param)

    total = torch.zeros(())
    for idx in SPLITS[split]:  # gradient accumulation
        micro = _loss_of(param, rows, rollout_ids, adv, weights, idx, cfg)
        micro.backward()
        total = total + micro.detach()
    assert total.item() == pytest.approx(full.item(), abs=TOL)
    assert torch.allclose(param.grad, full_grad, atol=TOL, rtol=0)
    assert full_grad.abs().sum() > 0


def test_rollout_token_mean_equal_weight_per_rollout():
    masks = [torch.ones(1), torch.ones(100), torch.ones(3)]
    w = loss_weights(masks, ["long", "long", "short"], "rollout-token-mean")
    per_rollout = {"long": float(w[0].sum() + w[1].sum()), "short": float(w[2].sum())}
    assert per_rollout == pytest.approx({"long": 0.5, "short": 0.5})
    for a, b in itertools.combinations([float(x) for x in w[1]], 2):
        assert a == b


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_micro_batch_losses_match_verl_with_global_batch_info(verl, mode, dual):
    """verl's non-deprecated vanilla loss, given the global token/sequence counts per micro-batch."""
    core, _ = verl
    from verl.workers.config import ActorConfig

    g = torch.Generator().manual_seed(11)
    B, T = 6, 8
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g) * 0.5
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[4] = 0
    actor = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_c=dual if dual is not None else 1e9,
                        ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    actor.global_batch_info.update(batch_num_tokens=mask.sum(), global_batch_size=(mask.sum(-1) > 0).sum())
    weights = torch.stack(loss_weights(list(mask), [str(i) for i in range(B)], mode))
    cfg = LossConfig(agg=mode, dual_clip_c=dual)
    for idx in ([0, 1, 2], [3, 4], [5]):
        ref, metrics = core.compute_policy_loss_vanilla(old[idx], logp[idx], adv[idx], mask[idx], mode, actor)
        ours, sums = policy_loss(logp[idx], old[idx], adv[idx], weights[idx], cfg)
        assert ours.item() == pytest.approx(ref.item(), abs=TOL)
        n = sums["response_tokens"]
        assert (sums["clipped_tokens"] / n).item() == pytest.approx(metrics["actor/pg_clipfrac"], abs=TOL)


def test_dual_clip_stops_a_stale_token_with_negative_advantage_from_dominating():
    # A token sampled at probability 0.01 that the current policy gives 0.2 (ratio 20), in a failed
    # rollout (A < 0): the plain PPO loss is unclipped there and pushes with weight 20|A|; the dual
    # clip (the default, c = 3) caps its loss at 3|A| and zeroes its gradient. A < 0 tokens with
    # ratio below c keep their gradient, so ordinary tokens are untouched.
    old = torch.log(torch.tensor([[0.01, 0.5]]))
    logp = torch.log(torch.tensor([[0.2, 0.5]])).requires_grad_(True)
    adv = torch.full((1, 2), -1.0)
    weights = torch.ones(1, 2)
    grads = {}
    for c in (None, 3.0):
        logp.grad = None
        loss, _ = policy_loss(logp, old, adv, weights, LossConfig(agg="token-mean", dual_clip_c=c))
        loss.backward()
        grads[c] = logp.grad.clone()
    assert grads[None][0, 0].item() == pytest.approx(20.0, rel=1e-4)  # d(-A r)/dlogp = |A| r
    assert grads[3.0][0, 0].item() == 0.0
    assert grads[None][0, 1].item() == grads[3.0][0, 1].item() == pytest.approx(1.0)
    assert LossConfig().dual_clip_c == 3.0
