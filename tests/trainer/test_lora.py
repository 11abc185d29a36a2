"""LoRA in the torch engine: only the adapter trains, it starts as the base exactly, the reference
is the base with the adapter off, checkpoints are adapter folders that resume exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from lightning_middleware.rows import Row  # noqa: E402
from trainer_backend.algorithms.losses import DPOConfig, LossConfig  # noqa: E402
from trainer_backend.engines.lora import AdapterConfig, is_adapter_dir  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.trainer.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("lora") / "m", vocab=64, hidden=32, layers=2)


def _rows(label: bool = False) -> list[Row]:
    def row(rid: str, task: str, ids: list[int], mask: list[int], adv: float) -> Row:
        return Row(rollout_id=rid, task_id=task, agent=None, input_ids=tuple(ids), loss_mask=tuple(mask),
                   behaviour_logprobs=None, advantage=adv, reward=max(adv, 0.0))
    return [row("a", "t", [1, 2, 3, 4, 5], [0, 0, 1, 1, 1], 1.0), row("b", "t", [1, 2, 6, 7], [0, 0, 1, 1], -1.0),
            row("c", "u", [3, 9, 10, 11], [0, 1, 1, 1], 1.0), row("d", "u", [3, 9, 12], [0, 1, 1], -1.0)]


def _flat(rows_logprobs: list[tuple[float, ...]]) -> list[float]:
    return [x for row in rows_logprobs for x in row]


def _engine(path: Path, **kw) -> TorchEngine:
    cfg = TorchEngineConfig(lr=1e-2, precision="fp32", old_logprobs="recompute", lora=AdapterConfig(rank=4), **kw)
    torch.manual_seed(0)  # LoRA's A matrices start random: two engines compared must draw the same
    return TorchEngine(path, cfg)


def _named(module: torch.nn.Module, trainable: bool) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters() if v.requires_grad == trainable}


def test_only_the_adapter_trains_and_it_starts_as_the_base(model_dir):
    engine = _engine(model_dir)
    plain = TorchEngine(model_dir, TorchEngineConfig(precision="fp32"))
    rows = _rows()
    assert _flat(engine.token_logprobs(rows)) == pytest.approx(_flat(plain.token_logprobs(rows)), abs=1e-6)  # B = 0
    frozen, adapter = _named(engine.model, False), _named(engine.model, True)
    assert adapter and all("lora_" in k for k in adapter)
    n_adapter = sum(v.numel() for v in adapter.values())
    assert n_adapter < 0.2 * sum(v.numel() for v in frozen.values())
    engine.step(rows)
    assert all(torch.equal(frozen[k], v) for k, v in _named(engine.model, False).items())
    assert any(not torch.equal(adapter[k], v) for k, v in _named(engine.model, True).items())
    assert _flat(engine.token_logprobs(rows)) != pytest.approx(_flat(plain.token_logprobs(rows)), abs=1e-6)


def test_an_adapter_checkpoint_resumes_exactly(model_dir, tmp_path):
    engine = _engine(model_dir)
    engine.step(_rows())
    ckpt = engine.save(tmp_path / "v1")
    assert is_adapter_dir(ckpt) and (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()  # the base is not copied
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir.resolve())
    resumed = TorchEngine(ckpt, TorchEngineConfig(lr=1e-2, precision="fp32", old_logprobs="recompute"))
    assert resumed.is_lora and resumed.resumed and resumed.base_dir == model_dir.resolve()
    assert _flat(resumed.token_logprobs(_rows())) == pytest.approx(_flat(engine.token_logprobs(_rows())), abs=1e-6)
    a, b = engine.step(_rows()), resumed.step(_rows())  # the same AdamW state: the same next step
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert all(torch.allclose(v, _named(resumed.model, True)[k], atol=1e-6)
               for k, v in _named(engine.model, True).items())


def test_the_reference_is_the_base_with_the_adapter_off(model_dir):
    engine = _engine(model_dir, loss=LossConfig(kl_coef=0.1))
    assert engine.ref_model is None  # no second copy of the model
    for _ in range(3):
        m = engine.step(_rows())
    assert m["kl_ref"] > 0  # the adapter moved the policy away from the base
    plain = TorchEngine(model_dir, TorchEngineConfig(precision="fp32"))
    from trainer_backend.engines.batching import make_micro_batch

    rows = _rows()
    weights = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rows]
    mb = make_micro_batch(rows, range(len(rows)), weights)
    base = plain._forward(plain.model, mb, with_entropy=False)[0]
    assert torch.allclose(engine._reference_logprobs(mb), base, atol=1e-6)


def test_dpo_and_micro_batches_with_lora(model_dir):
    one = _engine(model_dir, dpo=DPOConfig(beta=0.5))
    many = _engine(model_dir, dpo=DPOConfig(beta=0.5), micro_batch_tokens=5)
    m1, mk = one.step(_rows()), many.step(_rows())
    assert mk["micro_batches"] == 4 and m1["dpo_loss"] == pytest.approx(0.6931, abs=1e-3)
    assert m1["grad_norm"] == pytest.approx(mk["grad_norm"], rel=1e-5)
    margins = [one.step(_rows())["rewards_margins"] for _ in range(3)]
    assert margins[-1] > margins[0] > 0


def test_a_trained_adapter_merges_into_a_plain_model_with_the_same_outputs(model_dir, tmp_path, capsys):
    """`lightning-mw merge-lora`: the merged folder has no adapter, loads with transformers alone,
    and gives the adapter's log-probs; bad input is one line each."""
    from transformers import AutoModelForCausalLM

    from lightning_middleware.cli import main

    engine = _engine(model_dir)
    for _ in range(3):
        engine.step(_rows())  # B moves away from 0: the merge has something to add
    ckpt = engine.save(tmp_path / "v3")
    trained = _flat(engine.token_logprobs(_rows()))
    assert trained != pytest.approx(_flat(TorchEngine(model_dir, TorchEngineConfig(precision="fp32"))
                                          .token_logprobs(_rows())), abs=1e-4)
    out = tmp_path / "merged"
    assert main(["merge-lora", str(ckpt), "--out", str(out)]) == 0
    assert not is_adapter_dir(out) and (out / "model.safetensors").is_file()
    assert (out / "tokenizer_config.json").read_text() == (model_dir / "tokenizer_config.json").read_text()
    assert json.loads((out / "merged_from.json").read_text())["base"] == str(model_dir.resolve())
    merged = TorchEngine(out, TorchEngineConfig(precision="fp32"))
    assert not merged.is_lora
    assert _flat(merged.token_logprobs(_rows())) == pytest.approx(trained, abs=1e-5)
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 64  # a plain folder

    capsys.readouterr()
    assert main(["merge-lora", str(ckpt), "--out", str(out)]) == 2  # never over an existing model
    assert main(["merge-lora", str(model_dir), "--out", str(tmp_path / "x")]) == 2  # not an adapter
    assert main(["merge-lora", str(tmp_path / "nowhere"), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("lightning-mw merge-lora: ") for line in err)
    assert "not empty" in err[0] and "not a LoRA adapter folder" in err[1] and "no adapter folder" in err[2]
