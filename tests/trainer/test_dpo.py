"""DPO: the loss and its gradient against TRL's DPOTrainer (sigmoid loss) to 1e-6, pairs from task
groups (ties, groups of one, the middle rollouts), rows back to pairs, and the torch engine's DPO
step: exact across micro-batches, rollouts split in rows, the margin grows, offline from an export."""

from __future__ import annotations

import json
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from lightning_middleware.records import Rollout
from lightning_middleware.rows import Row
from trainer_backend.algorithms.advantages import Pair, pairs_from_groups, pairs_from_rows, preference_advantages
from trainer_backend.algorithms.losses import DPOConfig, dpo_loss, rollout_coefficients

TOL = 1e-6


def _trl_loss(model, ref_model, input_ids: torch.Tensor, completion_mask: torch.Tensor, beta: float):
    """TRL's DPOTrainer._compute_loss (trl 1.8-1.12, the range that verl 0.9.1 can import beside) on a
    batch [chosen..., rejected...]: TRL's own code on a real model; `self` holds the settings it reads."""
    trl = pytest.importorskip("trl")
    from trl.trainer.utils import selective_log_softmax

    with torch.no_grad():
        ref = selective_log_softmax(ref_model(input_ids=input_ids).logits[:, :-1], input_ids[:, 1:])
        ref_logps = (ref * completion_mask[:, 1:]).sum(-1)
    P = input_ids.shape[0] // 2
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = types.SimpleNamespace(
        model=model, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, label_smoothing=0.0)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion_mask,
              "ref_chosen_logps": ref_logps[:P], "ref_rejected_logps": ref_logps[P:]}
    loss = trl.DPOTrainer._compute_loss(trainer, model, inputs, False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.trainer.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("dpo") / "m", vocab=64, hidden=32, layers=2)


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory) -> Path:
    from tests.trainer.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("dpo-ref") / "m", vocab=64, hidden=32, layers=2, seed=1)


def _pair_batch(seed: int, P: int = 3, T: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (2 * P, T), generator=g)
    mask = torch.zeros(2 * P, T, dtype=torch.long)
    for i in range(2 * P):
        start = int(torch.randint(1, 4, (1,), generator=g))
        mask[i, start:] = (torch.rand(T - start, generator=g) > 0.2).long()  # observation tokens inside
        mask[i, -1] = 1
    return ids, mask


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_the_engines_dpo_step_matches_trl(model_dir, ref_dir, seed, beta):
    """The loss, its gradient and TRL's reward metrics, on a real model against another reference."""
    from transformers import AutoModelForCausalLM

    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    ids, mask = _pair_batch(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    ref_model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ref_loss, ref_metrics = _trl_loss(model, ref_model, ids, mask, beta)
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    ref_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads])))

    P = ids.shape[0] // 2
    rows = [_row(f"{'cr'[i // P]}{i % P}", f"p{i % P}", ids[i].tolist(), mask[i].tolist(), 1.0 if i < P else -1.0)
            for i in range(2 * P)]
    engine = TorchEngine(model_dir, TorchEngineConfig(lr=1e-3, precision="fp32", grad_clip=None,
                                                      dpo=DPOConfig(beta=beta), reference_dir=str(ref_dir),
                                                      micro_batch_tokens=2 * ids.shape[1]))
    m = engine.step(rows)
    assert m["micro_batches"] == 3
    assert m["dpo_loss"] == pytest.approx(ref_loss.item(), abs=TOL)
    assert m["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert m[k.replace("/", "_")] == pytest.approx(ref_metrics[k], abs=1e-5), k


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_two_pass_gradient_is_the_losss(seed):
    """sum_r c_r * logp_r with c_r = dL/dlogp_r (the engine's second pass) has the loss's gradient."""
    g = torch.Generator().manual_seed(seed)
    P, T = 4, 9
    mask = (torch.rand(2 * P, T, generator=g) > 0.3).float()
    per_token = (-torch.rand(2 * P, T, generator=g) * 3).requires_grad_(True)
    ref = -torch.rand(2 * P, generator=g) * 10
    seq = (per_token * mask).sum(-1)
    loss, _ = dpo_loss(seq[:P], seq[P:], ref[:P], ref[P:], DPOConfig(beta=0.3))
    direct, = torch.autograd.grad(loss, per_token)
    ids = [f"c{i}" for i in range(P)] + [f"r{i}" for i in range(P)]
    pairs = [Pair(str(i), f"c{i}", f"r{i}") for i in range(P)]
    coef, m = rollout_coefficients(pairs, dict(zip(ids, seq.tolist())), dict(zip(ids, ref.tolist())),
                                   DPOConfig(beta=0.3))
    assert m["dpo_loss"] == pytest.approx(loss.item(), abs=TOL)
    surrogate = (torch.tensor([coef[i] for i in ids]).unsqueeze(-1) * per_token * mask).sum()
    two_pass, = torch.autograd.grad(surrogate, per_token)
    assert torch.allclose(two_pass, direct, atol=TOL, rtol=0)


def test_label_smoothing_is_conservative_dpo():
    d = torch.tensor([0.7])
    loss, _ = dpo_loss(d, torch.zeros(1), torch.zeros(1), torch.zeros(1), DPOConfig(beta=1.0, label_smoothing=0.2))
    expected = -(0.8 * torch.nn.functional.logsigmoid(d) + 0.2 * torch.nn.functional.logsigmoid(-d))
    assert loss.item() == pytest.approx(expected.item(), abs=TOL)


def _rollout(rid: str, task: str, reward: float | None, t: float) -> Rollout:
    return Rollout(id=rid, task_id=task, final_reward=reward, created_at=t)


def test_pairs_are_best_against_worst_per_group():
    rollouts = [_rollout("a1", "a", 1.0, 1), _rollout("a2", "a", 0.5, 2), _rollout("a3", "a", 0.0, 3),
                _rollout("a4", "a", 1.0, 0.5), _rollout("a5", "a", 0.0, 0.1),  # ties: the earliest wins
                _rollout("b1", "b", 1.0, 1), _rollout("b2", "b", 1.0, 2),  # a tie: no pair
                _rollout("c1", "c", 1.0, 1),  # a group of one
                _rollout("d1", "d", None, 1), _rollout("d2", "d", 0.0, 2), _rollout("d3", "d", 0.3, 3)]
    pairs = pairs_from_groups(rollouts)
    assert pairs == [Pair("a", "a4", "a5"), Pair("d", "d3", "d2")]
    assert preference_advantages(pairs) == {"a4": 1.0, "a5": -1.0, "d3": 1.0, "d2": -1.0}


def test_rows_back_to_pairs_and_their_errors():
    assert pairs_from_rows(["t", "t", "t"], ["x", "x", "y"], [1.0, 1.0, -1.0]) == [Pair("t", "x", "y")]
    with pytest.raises(ValueError, match="lacks its rejected"):
        pairs_from_rows(["t"], ["x"], [1.0])
    with pytest.raises(ValueError, match="two chosen"):
        pairs_from_rows(["t", "t", "t"], ["x", "z", "y"], [1.0, 1.0, -1.0])
    with pytest.raises(ValueError, match=r"\+1 \(chosen\)"):
        pairs_from_rows(["t"], ["x"], [0.3])


# ---------------------------------------------------------------- the engine's DPO step


def _row(rid: str, task: str, ids: list[int], mask: list[int], label: float) -> Row:
    return Row(rollout_id=rid, task_id=task, agent=None, input_ids=tuple(ids), loss_mask=tuple(mask),
               behaviour_logprobs=None, advantage=label)


def _pair_rows() -> list[Row]:
    """Two pairs; the chosen rollout of pair p is split in two rows (a prefix break)."""
    return [_row("c1", "p", [1, 2, 3, 4], [0, 0, 1, 1], 1.0), _row("c1", "p", [5, 6, 7], [0, 1, 1], 1.0),
            _row("r1", "p", [1, 2, 9, 10, 11], [0, 0, 1, 1, 1], -1.0),
            _row("c2", "q", [3, 3, 12, 13], [0, 0, 1, 1], 1.0),
            _row("r2", "q", [3, 3, 14, 15, 16], [0, 0, 1, 0, 1], -1.0)]


def _engine(model_dir: Path, **kw):
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    return TorchEngine(model_dir, TorchEngineConfig(lr=1e-2, precision="fp32", dpo=DPOConfig(beta=0.5), **kw))


def test_dpo_step_is_exact_across_micro_batches_and_widens_the_margin(model_dir):
    one, many = _engine(model_dir), _engine(model_dir, micro_batch_tokens=5)
    m1, mk = one.step(_pair_rows()), many.step(_pair_rows())
    assert mk["micro_batches"] == 5 and m1["micro_batches"] == 1
    assert m1["dpo_loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference: -log sigmoid(0)
    for k in ("dpo_loss", "grad_norm"):
        assert m1[k] == pytest.approx(mk[k], rel=1e-5), k
    pa, pb = dict(one.model.named_parameters()), dict(many.model.named_parameters())
    assert all(torch.allclose(pa[k], pb[k], atol=1e-5) for k in pa)
    margins = [one.step(_pair_rows())["rewards_margins"] for _ in range(4)]
    assert margins[0] > 0 and margins[-1] > margins[0], margins
    assert one.step(_pair_rows())["rewards_accuracies"] == 1.0


def test_offline_dpo_from_an_exported_preference_file(model_dir, tmp_path):
    from trainer_backend.offline.dpo import preference_rows, train_offline_dpo

    path = tmp_path / "prefs.jsonl"
    records = [{"id": f"t{i}", "task_id": f"t{i}", "chosen_input_ids": [1, 2, 3 + i, 4],
                "chosen_loss_mask": [0, 0, 1, 1], "rejected_input_ids": [1, 2, 9, 10 + i],
                "rejected_loss_mask": [0, 0, 1, 1]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = preference_rows(path)
    assert len(rows) == 12 and {r.advantage for r in rows} == {1.0, -1.0}
    result = train_offline_dpo(path, model_dir, tmp_path / "out", config=DPOConfig(beta=0.5), lr=1e-2,
                               pairs_per_step=4, epochs=2, seed=0)
    assert result.steps == 4  # 6 pairs, 4 a step -> 2 steps an epoch
    assert result.metrics[-1]["rewards_margins"] > result.metrics[0]["rewards_margins"]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "chosen_input_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 1: .*rejected_input_ids"):
        preference_rows(bad)
