"""The chunked output layer (algorithms/logprobs.py) and the activation budget: the same log-probs,
entropies, losses and gradients as the full-vocabulary path, on the edge cases."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from lightning_middleware.rows import Row  # noqa: E402
from tests.trainer.tiny_models import save_tiny_qwen2  # noqa: E402
from trainer_backend.algorithms.logprobs import (  # noqa: E402  # noqa: E402
    chunk_positions,
    entropy_from_logits,
    head_logprobs,
    sampled_logits,  # noqa: E402
    split_head,
    token_logprobs,
)
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.engines.batching import activation_bytes_per_token  # noqa: E402
from trainer_backend.engines.lora import AdapterConfig  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

VOCAB = 96
POSITION_MB = 4 * VOCAB / 2**20  # logits_budget_mb that holds one position's fp32 logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_head"), vocab=VOCAB)


def reference(hidden, weight, bias, targets, sampling, with_entropy=True):
    """The plain full-vocabulary computation the chunks must reproduce."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if any(s is not None for s in sampling):
        logits = sampled_logits(logits, *sampling)
    return token_logprobs(logits, targets), entropy_from_logits(logits) if with_entropy else None


def leaf_inputs(B, K, H, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, K, H, generator=g).requires_grad_()
    head = torch.nn.Linear(H, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=g))
    targets = torch.randint(0, VOCAB, (B, K), generator=g)
    return hidden, head, targets


def sampling_case(kind, B, K):
    if kind == "plain":
        return (None, None, None)
    temp = torch.full((B, K), 0.7)
    temp[0, 0] = 1.3
    if kind == "temperature":
        return (temp, None, None)
    top_k = torch.full((B, K), 5, dtype=torch.long)
    top_k[-1, -1] = 0  # off for one position
    top_p = torch.full((B, K), 0.9) if kind == "top-k-top-p" else None
    return (temp, top_p, top_k)


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (3, 5)])
@pytest.mark.parametrize("chunk", [1, 3, 4, 1000])
@pytest.mark.parametrize("kind", ["plain", "temperature", "top-k", "top-k-top-p"])
def test_chunks_match_the_full_vocabulary_path(shape, chunk, kind):
    """Log-probs, entropies and the gradients of hidden states, weight and bias of a loss that
    uses both; chunk 3 on K = 3 puts every chunk boundary at a row's edge, 4 does not."""
    B, K = shape
    hidden, head, targets = leaf_inputs(B, K, 16)
    sampling = sampling_case(kind, B, K)
    g = torch.Generator().manual_seed(7)
    w_lp, w_ent = torch.randn(B, K, generator=g), torch.randn(B, K, generator=g)
    grads = []
    outs = []
    for run in ("chunked", "reference"):
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        if run == "chunked":
            logp, ent = head_logprobs(hidden, head, targets, sampling, True, chunk)
        else:
            logp, ent = reference(hidden, head.weight, head.bias, targets, sampling)
        assert ent is not None
        ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
        outs.append((logp.detach(), ent.detach()))
        grads.append([hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()])
    (lp1, e1), (lp2, e2) = outs
    torch.testing.assert_close(lp1, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e1, e2, rtol=1e-5, atol=1e-5)
    for a, b, name in zip(grads[0], grads[1], ("hidden", "weight", "bias")):
        assert float(b.abs().max()) > 0, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_without_entropy_and_with_a_frozen_head():
    """No entropy asked: None back; a frozen (tied, freeze_embeddings) weight gets no gradient."""
    hidden, head, targets = leaf_inputs(2, 4, 8, bias=False)
    head.weight.requires_grad_(False)
    logp, ent = head_logprobs(hidden, head, targets, (None, None, None), False, 3)
    assert ent is None
    logp.sum().backward()
    ref, _ = reference(hidden.detach(), head.weight, None, targets, (None, None, None), False)
    torch.testing.assert_close(logp.detach(), ref, rtol=1e-5, atol=1e-5)
    assert head.weight.grad is None and hidden.grad is not None


def test_chunk_positions():
    assert chunk_positions(49_152, 256) == 1365  # 256 MB of fp32 49k-vocabulary logits
    assert chunk_positions(49_152, 0.001) == 1  # always at least one position


def test_split_head_finds_the_decoder_and_tied_output_layer(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    split = split_head(model)
    assert split is not None
    decoder, out = split
    assert decoder is model.model and out is model.lm_head
    assert out.weight is model.get_input_embeddings().weight  # tied: one parameter, both uses
    model.config.final_logit_softcapping = 30.0  # logits that are not lm_head(hidden): the model's own forward
    assert split_head(model) is None


# ---------------------------------------------------------------- through the engine


def rows_with_edges() -> list[Row]:
    """Rows of different lengths (padding), a response with a hole (tool result in the middle),
    a one-token response, temperature != 1 and top-k on some tokens, behaviour log-probs off by a bit."""
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())

    specs = [  # (mask, advantage, temperature, top_k)
        ((0, 0, 0, 1, 1, 0, 0, 1, 1, 1), 1.0, 0.7, 5),
        ((0, 0, 1), -1.5, None, None),  # one response token, shortest row
        ((0, 0, 0, 0, 1, 1, 1), 0.5, 1.3, None),
        ((0, 1, 1, 0, 1), -0.5, None, 7),
    ]
    rows = []
    for i, (mask, adv, temp, top_k) in enumerate(specs):
        n = len(mask)
        rows.append(Row(rollout_id=f"r{i}", task_id=f"t{i // 2}", agent=None, input_ids=ids(n), loss_mask=mask,
                        behaviour_logprobs=tuple(-2.0 * m for m in mask), advantage=adv,
                        temperature=None if temp is None else (temp,) * n,
                        top_k=None if top_k is None else (top_k,) * n))
    return rows


def sgd_step(model_dir, rows, **config):
    """One step with SGD lr 1 (each weight moves by exactly -grad): metrics, log-probs before it,
    each weight's move. `loss` (in `config`): the LossConfig, entropy on and a dual clip by default."""
    loss = config.pop("loss", LossConfig(entropy_coef=0.01, dual_clip_c=3.0))
    torch.manual_seed(0)  # LoRA's A is initialised at random
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", grad_clip=None, loss=loss, **config))
    eng.optimizer = torch.optim.SGD(eng.master, lr=1.0)
    before = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    logprobs = eng.token_logprobs(rows)
    metrics = eng.step(rows)
    return metrics, logprobs, {k: before[k] - v for k, v in eng.model.state_dict().items()}


@pytest.mark.parametrize("lora", [False, True])
def test_the_engine_takes_the_same_step_with_chunked_logits(model_dir, lora):
    """One position per chunk versus the model's own forward: equal log-probs, loss, entropy
    (its coefficient is on, so its gradient counts) and every parameter's gradient, tied
    embeddings included; with LoRA, the adapter's."""
    rows = rows_with_edges()
    extra = {"lora": AdapterConfig(rank=4, alpha=8)} if lora else {}
    m1, lp1, g1 = sgd_step(model_dir, rows, logits_budget_mb=POSITION_MB, **extra)
    m2, lp2, g2 = sgd_step(model_dir, rows, logits_budget_mb=None, **extra)
    for a, b in zip(lp1, lp2):
        assert a == pytest.approx(b, abs=1e-5)
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "approx_kl", "clip_frac"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key
    moved = [k for k in g2 if float(g2[k].abs().max()) > 0]
    assert moved and (lora or "model.embed_tokens.weight" in moved)
    scale = max(float(g.abs().max()) for g in g2.values())
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6 * scale, msg=k)


def test_the_activation_budget_splits_micro_batches_and_keeps_the_step(model_dir):
    """A budget of ~2 rows' activations: more micro-batches, the same gradient."""
    rows = rows_with_edges()
    per_token = activation_bytes_per_token(layers=2, hidden=64, intermediate=128, dtype_bytes=4)
    assert per_token == 2 * (13 * 64 + 5 * 128) * 4
    budget_mb = 20 * per_token / 2**20  # 20 padded tokens: two rows of the longest (10)
    m1, _, g1 = sgd_step(model_dir, rows, activation_budget_mb=budget_mb)
    m2, _, g2 = sgd_step(model_dir, rows, activation_budget_mb=None)
    assert m1["micro_batches"] == 2 and m2["micro_batches"] == 1
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-6)
    scale = max(float(g.abs().max()) for g in g2.values())
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6 * scale, msg=k)


def test_checkpointed_activations_are_estimated_smaller():
    def smol(dtype_bytes: int, checkpointed: bool = False) -> int:  # SmolLM2-135M's shape
        return activation_bytes_per_token(layers=30, hidden=576, intermediate=1536, dtype_bytes=dtype_bytes,
                                          checkpointed=checkpointed)

    full = smol(4)
    assert full == pytest.approx(1.82e6, rel=0.01)
    assert smol(4, checkpointed=True) < full / 10
    assert smol(2) == full // 2
    assert dataclasses.is_dataclass(TorchEngineConfig) and TorchEngineConfig().activation_budget_mb == 4096
