"""The in-process PyTorch engine on a tiny random Qwen2 model (CPU, a few seconds)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lightning_middleware.rows import Row  # noqa: E402
from tests.trainer.tiny_models import save_tiny_qwen2  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.engines.base import Engine  # noqa: E402
from trainer_backend.engines.batching import split_micro_batches  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

VOCAB = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), vocab=VOCAB)
    (d / "chat_template.jinja").write_text("{{ messages }}")
    return d


def make_rows(prompts_by_rollout: dict[str, list[list[int]]], completion_len: int = 4,
              advantages: dict[str, float] | None = None) -> list[Row]:
    rows = []
    g = torch.Generator().manual_seed(1)
    for rid, prompts in prompts_by_rollout.items():
        for p in prompts:
            comp = torch.randint(0, VOCAB, (completion_len,), generator=g).tolist()
            rows.append(Row(rollout_id=rid, task_id="t", agent=None, input_ids=tuple(p + comp),
                            loss_mask=(0,) * len(p) + (1,) * completion_len, behaviour_logprobs=None,
                            advantage=(advantages or {}).get(rid, 0.0)))
    return rows


def with_behaviour(engine: TorchEngine, rows: list[Row]) -> list[Row]:
    """Fill behaviour log-probs from the current weights, as vLLM would have sampled them."""
    out = []
    for r in rows:
        lp = response_logprobs(engine, r)
        out.append(dataclasses.replace(r, behaviour_logprobs=tuple(lp)))
    return out


@torch.no_grad()
def response_logprobs(engine: TorchEngine, row: Row) -> list[float]:
    ids = torch.tensor([row.input_ids])
    logits = engine.model(input_ids=ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return [0.0] + [float(x) if m else 0.0 for x, m in zip(lp, row.loss_mask[1:])]


def mean_response_logprob(engine: TorchEngine, rows: list[Row]) -> float:
    vals = [lp for r in rows for lp, m in zip(response_logprobs(engine, r), r.loss_mask) if m]
    return sum(vals) / len(vals)


PROMPTS = {"good": [[1, 2, 3, 4], [1, 2, 3, 4, 9, 9, 5]], "bad": [[7, 8, 9]]}


def test_split_micro_batches():
    assert split_micro_batches([3, 3, 3], 6) == [[0, 1], [2]]
    assert split_micro_batches([10, 2], 4) == [[0], [1]]  # an over-long row still gets its own batch
    assert split_micro_batches([2, 2, 2, 2], 100) == [[0, 1, 2, 3]]
    assert split_micro_batches([], 10) == []


def test_steps_raise_positive_and_lower_negative_logprobs(model_dir):
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=3e-3, grad_clip=1.0,
                                                    loss=LossConfig(clip_low=10.0, clip_high=10.0)))
    assert isinstance(eng, Engine)
    rows = with_behaviour(eng, make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0}))
    good = [r for r in rows if r.rollout_id == "good"]
    bad = [r for r in rows if r.rollout_id == "bad"]
    before_good, before_bad = mean_response_logprob(eng, good), mean_response_logprob(eng, bad)
    losses = [eng.step(rows)["loss"] for _ in range(4)]
    assert losses[0] == pytest.approx(0.0, abs=1e-5)  # ratio 1: -(1/2)(+1) - (1/2)(-1)
    assert losses[-1] < losses[0] and all(b < a for a, b in zip(losses, losses[1:]))
    assert mean_response_logprob(eng, good) > before_good
    assert mean_response_logprob(eng, bad) < before_bad
    assert eng.policy_version == 4


def test_metrics_and_recomputed_old_logprobs(model_dir):
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-3, micro_batch_tokens=8))
    rows = make_rows(PROMPTS, advantages={"good": 0.5, "bad": -0.5})  # no behaviour log-probs: recomputed
    m = eng.step(rows)
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-6) and m["clip_frac"] == 0.0
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["micro_batches"] == 3 and m["rows"] == 3 and m["rollouts"] == 2
    assert m["response_tokens"] == 12 and m["tokens"] == sum(len(r) for r in rows)
    assert m["grad_norm"] > 0 and m["entropy"] > 0 and m["time_s"] > 0 and m["policy_version"] == 1
    with pytest.raises(ValueError):
        eng.step([])


def test_micro_batching_does_not_change_the_step(model_dir):
    """The summed micro-batch gradients equal the one-batch gradient up to fp32 summation order.

    Checked on the gradient (an SGD step of lr 1 moves each weight by exactly -grad), not after
    AdamW: Adam's first step moves a weight by ~lr * sign(grad), so a gradient that is 0 up to
    rounding flips sign with the summation order and the weights differ by 2 * lr.
    """
    rows = make_rows(PROMPTS, advantages={"good": 1.0, "bad": -2.0})
    results = []
    for budget in (8, 10_000):  # one row per micro-batch vs all in one
        eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-3, grad_clip=None,
                                                       micro_batch_tokens=budget))
        eng.optimizer = torch.optim.SGD(eng.master, lr=1.0)
        rows_b = with_behaviour(eng, rows)
        # perturb behaviour log-probs so the ratio is not 1 and clipping matters
        rows_b = [dataclasses.replace(r, behaviour_logprobs=tuple(x - 0.3 * m for x, m in
                                                                   zip(r.behaviour_logprobs, r.loss_mask)))
                  for r in rows_b]
        before = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
        m = eng.step(rows_b)
        results.append((m, {k: before[k] - v for k, v in eng.model.state_dict().items()}))
    (m1, g1), (m2, g2) = results
    assert m1["micro_batches"] == 3 and m2["micro_batches"] == 1
    for key in ("loss", "grad_norm", "clip_frac", "approx_kl", "entropy", "ratio_max"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key
    assert m1["ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-4)  # a max over micro-batches, not a sum
    scale = max(float(g.abs().max()) for g in g2.values())
    assert scale > 1e-4  # the step did move the weights
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6 * scale, msg=k)


def test_gradient_checkpointing_takes_the_same_step(model_dir):
    """Recomputing activations in the backward pass changes memory, not the step: the same loss,
    metrics and gradient (an SGD step of lr 1, as above) with it on and off. Checked to be on:
    the model reports it, and its backward runs a layer's forward once more."""
    rows = make_rows(PROMPTS, advantages={"good": 1.0, "bad": -2.0})
    results = []
    for checkpointing in (True, False):
        eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-3, grad_clip=None,
                                                       gradient_checkpointing=checkpointing))
        assert eng.model.is_gradient_checkpointing == checkpointing
        eng.optimizer = torch.optim.SGD(eng.master, lr=1.0)
        # counted in the MLP's forward itself: module hooks do not run when checkpointing recomputes
        mlp = eng.model.model.layers[0].mlp
        layer_calls: list[int] = []
        mlp.forward = lambda x, calls=layer_calls, fwd=mlp.forward: (calls.append(1), fwd(x))[1]
        rows_b = [dataclasses.replace(r, behaviour_logprobs=tuple(x - 0.3 * m for x, m in
                                                                   zip(r.behaviour_logprobs, r.loss_mask)))
                  for r in with_behaviour(eng, rows)]
        layer_calls.clear()
        before = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
        m = eng.step(rows_b)
        results.append((m, len(layer_calls), {k: before[k] - v for k, v in eng.model.state_dict().items()}))
    (m_on, calls_on, g_on), (m_off, calls_off, g_off) = results
    assert calls_on == calls_off + 1 and calls_off > 0  # the recomputation happened
    for key in ("loss", "grad_norm", "clip_frac", "approx_kl", "entropy", "ratio_max"):
        assert m_on[key] == pytest.approx(m_off[key], rel=1e-5, abs=1e-6), key
    scale = max(float(g.abs().max()) for g in g_off.values())
    assert scale > 1e-4
    for k in g_on:
        torch.testing.assert_close(g_on[k], g_off[k], rtol=1e-4, atol=1e-6 * scale, msg=k)


def test_frozen_embeddings_and_options(model_dir):
    cfg = TorchEngineConfig(lr=1e-2, freeze_embeddings=True, precision="bf16-autocast", gradient_checkpointing=True,
                            loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, dual_clip_c=3.0))
    eng = TorchEngine(model_dir, cfg)
    emb0 = eng.model.get_input_embeddings().weight.detach().clone()
    layer0 = eng.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    m = eng.step(make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0}))
    assert all(v == v for v in m.values())  # no NaN
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-2)  # the reference is the start weights
    assert torch.equal(eng.model.get_input_embeddings().weight, emb0)
    assert not torch.equal(eng.model.model.layers[0].mlp.up_proj.weight, layer0)
    m2 = eng.step(make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0}))
    assert m2["kl_ref"] > 0


def test_bf16_precision_trains_fp32_masters_and_saves_them(model_dir, tmp_path):
    cfg = TorchEngineConfig(lr=3e-3, precision="bf16", loss=LossConfig(clip_low=10.0, clip_high=10.0))
    eng = TorchEngine(model_dir, cfg)
    assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters())
    assert all(m.dtype == torch.float32 for m in eng.master) and len(eng.master) == len(eng.params)
    rows = make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0})
    good = [r for r in rows if r.rollout_id == "good"]
    before = mean_response_logprob(eng, good)
    start = [m.detach().clone() for m in eng.master]
    for _ in range(3):
        m = eng.step(rows)
        assert m["grad_norm"] > 0 and m["entropy"] > 0
    assert mean_response_logprob(eng, good) > before
    for m, p in zip(eng.master, eng.params):
        assert torch.equal(p, m.to(torch.bfloat16))  # the model is the masters' rounding
    # an update smaller than bf16's resolution still moves the fp32 master (the point of keeping it)
    assert sum(int((m != m0).sum()) for m, m0 in zip(eng.master, start)) > \
        sum(int((p != m0.to(torch.bfloat16)).sum()) for p, m0 in zip(eng.params, start))

    out = eng.save(tmp_path / "bf16")
    saved = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    by_id = {id(p): m for p, m in zip(eng.params, eng.master)}
    for name, t in eng.model.state_dict(keep_vars=True).items():
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], by_id.get(id(t), t).detach().float()), name


def test_compiled_layers_take_the_same_step(model_dir):
    """Compiled layers compute the same loss, gradient norm and update as eager ones, up to rounding.

    The update is compared per tensor, relative to its size: Adam divides each gradient element by
    its own running RMS, so an element whose gradient is near zero turns the kernels' different
    rounding into a visible step (on an AVX2 EPYC: 6e-6 absolute in mlp.down_proj after two steps at
    lr 1e-3, a relative difference below 1e-4 in every tensor). k_proj's bias is left out: its
    gradient is zero in exact arithmetic (softmax ignores a constant added to every key's score), so
    Adam makes steps of ~lr out of rounding alone, and those differ wherever the kernels do."""
    rows = make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0})
    results = []
    for compiled in (False, True):
        eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-3, compile=compiled))
        metrics = [eng.step(rows) for _ in range(2)]
        results.append((metrics, {k: v.detach().clone() for k, v in eng.model.state_dict().items()}))
    (m_eager, s_eager), (m_comp, s_comp) = results
    assert set(s_eager) == set(s_comp)  # compiling in place keeps the checkpoint's names
    for a, b in zip(m_eager, m_comp):
        for key in ("loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    init = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for k in s_eager:
        if k.endswith("self_attn.k_proj.bias"):
            continue
        step_eager, step_comp = s_eager[k] - init[k], s_comp[k] - init[k]
        assert float((step_eager - step_comp).norm()) <= 1e-3 * float(step_eager.norm()) + 1e-7, k


def test_precision_is_checked(model_dir):
    with pytest.raises(ValueError, match="precision must be one of"):
        TorchEngine(model_dir, TorchEngineConfig(precision="fp16"))
    with pytest.raises(ValueError, match="master weights"):
        TorchEngine(model_dir, TorchEngineConfig(precision="bf16"), dtype=torch.bfloat16)


def test_save_reloads_with_transformers(model_dir, tmp_path):
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-2))
    eng.step(make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0}))
    out = eng.save(tmp_path / "v1")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    mine, theirs = eng.model.state_dict(), reloaded.state_dict()
    assert set(mine) == set(theirs)
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    changed = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(changed[k], theirs[k]) for k in theirs)


def test_recompute_option_ignores_behaviour_logprobs(model_dir):
    rows = make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0})
    stale = [dataclasses.replace(r, behaviour_logprobs=tuple(-5.0 * m for m in r.loss_mask)) for r in rows]
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", old_logprobs="recompute"))
    assert eng.step(stale)["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    # behaviour mode uses them where present and recomputes only the row that lacks them
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", old_logprobs="behaviour"))
    mixed = stale[:2] + rows[2:]
    m = eng.step(mixed)
    assert m["approx_kl"] < -0.5 and m["clip_frac"] > 0  # old = -5 vs about -log(48) = -3.9 on 8 of 12 tokens
    with pytest.raises(ValueError):
        TorchEngine(model_dir, TorchEngineConfig(precision="fp32", old_logprobs="vllm")).step(rows)


def test_set_lr_changes_the_next_update_and_rejects_nonsense(model_dir):
    """A step at lr 0+ barely moves the weights; the same step at the engine's lr moves them."""
    rows = make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0})

    def moved(lr: float) -> float:
        eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-2))
        eng.set_lr(lr)
        assert eng.lr == lr
        before = [p.detach().clone() for p in eng.params]
        eng.step(with_behaviour(eng, rows))
        return sum(float((p - b).abs().sum()) for p, b in zip(eng.params, before))

    assert moved(1e-9) < moved(1e-2) / 1000
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-3))
    for bad in (0.0, -1e-4, float("nan")):
        with pytest.raises(ValueError, match="learning rate"):
            eng.set_lr(bad)
    assert eng.lr == 1e-3


def test_trainer_cli_flags_reach_the_torch_engine(model_dir):
    import argparse

    from trainer_backend.daemon.cli import add_cli, make_engine, settings_from
    from trainer_backend.daemon.settings import SettingsError

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())

    def engine_for(*flags: str) -> TorchEngine:
        args = parser.parse_args(["trainer", "--store", "sqlite:///x.db", "--model", str(model_dir), *flags])
        return make_engine(settings_from(args), model_dir, 0)

    from trainer_backend.engines.precision import bf16_probe

    assert engine_for().config.precision == ("bf16" if bf16_probe().native else "fp32")  # auto
    assert engine_for("--precision", "fp32").config.precision == "fp32"
    assert engine_for("--bf16").config.precision == "bf16"  # bf16 compute, fp32 masters: as verl's --bf16
    eng = engine_for("--bf16", "--precision", "bf16-autocast", "--compile")  # --precision wins
    assert eng.config.precision == "bf16-autocast" and eng.config.compile
    with pytest.raises(SettingsError, match="engine.precision"):
        engine_for("--precision", "fp16")
    assert engine_for().config.loss.dual_clip_c == 3.0  # verl's default clip_ratio_c
    assert engine_for("--dual-clip", "0").config.loss.dual_clip_c is None
    assert engine_for("--dual-clip", "5").config.loss.dual_clip_c == 5.0
    with pytest.raises(SettingsError, match="loss.dual_clip"):
        engine_for("--dual-clip", "0.5")
    eng = engine_for("--kl-coef", "0.05", "--kl-estimator", "k2", "--entropy-coef", "0.01", "--clip-high", "0.28",
                     "--lr-schedule", "cosine", "--warmup-steps", "3", "--max-steps", "20", "--algo", "gspo")
    loss = eng.config.loss
    assert (loss.kl_coef, loss.kl_kind, loss.entropy_coef, loss.clip_high) == (0.05, "k2", 0.01, 0.28)
    assert loss.ratio_level == "sequence" and loss.agg == "seq-mean-token-mean"  # GSPO's own aggregation
    assert (eng.config.lr_schedule, eng.config.warmup_steps, eng.config.total_steps) == ("cosine", 3, 20)
    assert eng.ref_model is not None and eng.config.reference_dir == str(model_dir)  # KL to the base model


def test_a_resumed_engine_continues_the_same_adamw_and_schedule(model_dir, tmp_path):
    """Checkpoints hold the optimizer's moments and the lr schedule's position: an engine built
    from a saved checkpoint takes exactly the step the original would have taken next."""
    rows = make_rows(PROMPTS, advantages={"good": 1.0, "bad": -1.0})
    cfg = TorchEngineConfig(precision="fp32", lr=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=6)
    eng = TorchEngine(model_dir, cfg)
    rows_b = with_behaviour(eng, rows)
    for _ in range(3):
        eng.step(rows_b)
    ckpt = eng.save(tmp_path / "ckpt")
    assert (ckpt / "trainer_state.pt").is_file()
    resumed = TorchEngine(ckpt, cfg, policy_version=eng.policy_version)
    assert resumed.resumed and not TorchEngine(model_dir, cfg).resumed
    assert resumed.lr == pytest.approx(eng.lr) and resumed.scheduler.last_epoch == 3
    a, b = eng.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]) for k in a)
    m1, m2 = eng.step(rows_b), resumed.step(rows_b)
    assert m1["lr"] == pytest.approx(m2["lr"]) and m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    for (k, x), y in zip(eng.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=k)


def test_lr_schedules() -> None:
    from trainer_backend.engines.torch_engine import lr_factor

    warm = TorchEngineConfig(lr_schedule="linear", warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    assert [lr_factor(warm, k) for k in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_factor(warm, 8) == pytest.approx(0.1 + 0.9 * 0.5) and lr_factor(warm, 50) == pytest.approx(0.1)
    cos = TorchEngineConfig(lr_schedule="cosine", total_steps=10)
    assert lr_factor(cos, 0) == 1.0 and lr_factor(cos, 5) == pytest.approx(0.5) and lr_factor(cos, 10) == 0.0
    assert lr_factor(TorchEngineConfig(), 10_000) == 1.0
    with pytest.raises(ValueError, match="lr_schedule"):
        TorchEngine(".", TorchEngineConfig(lr_schedule="step"))
