"""LoRA on the verl engine through verl 0.9.1's own LoRA support (engines/verl_lora.py), on CPU.

verl's real actor (ActorRolloutRefWorker -> TrainingWorker -> FSDP2 engine with `model.lora_rank`,
so verl applies peft itself) runs in one CPU process (tests/trainer/verl_cpu_lora.py, one
subprocess for the module: ~1.5 min), driven by `VerlEngine`'s own __init__, step and save.
Compared with the torch engine's peft LoRA on the same rows from the same adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("verl")

from tests.trainer.test_engine_verl import VOCAB, multi_turn_rows, perturbed_rows  # noqa: E402
from tests.trainer.tiny_models import save_tiny_qwen2  # noqa: E402
from tests.trainer.verl_subprocess import run_verl_helper  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.engines import lora  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from trainer_backend.engines.verl_engine import VerlEngineConfig, build_actor_config  # noqa: E402

ADAPTER = lora.AdapterConfig(rank=4, alpha=8)  # the helper's
N_ADAPTER_TENSORS = 2 * 7 * 2  # 2 layers x 7 linear layers x (A, B)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_verl_lora"), vocab=VOCAB)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory) -> Path:
    """A saved adapter with B != 0 (peft's own init has B = 0, where the loss is the base's and A gets
    no gradient): the same start for both engines, so losses and gradients are comparable."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir.resolve(), dtype=torch.float32)
    torch.manual_seed(11)
    model = peft.get_peft_model(base, lora.peft_config(ADAPTER))
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("adapter0")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rows(model_dir):
    return perturbed_rows(model_dir, multi_turn_rows())


@pytest.fixture(scope="module")
def verl_run(model_dir, adapter_dir, rows, tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_lora_run")
    torch.save(rows, out / "rows.pt")
    run_verl_helper("verl_cpu_lora.py", [str(model_dir), str(adapter_dir), str(out / "rows.pt"), str(out)], 600)
    return torch.load(out / "out.pt", weights_only=False), out


# ---------------------------------------------------------------- config (no worker)


def test_our_lora_maps_onto_verls_own_config_keys(model_dir, adapter_dir):
    full = build_actor_config(model_dir, VerlEngineConfig(lora=ADAPTER)).actor_rollout_ref
    m = full.model
    assert (m.lora_rank, m.lora_alpha, list(m.target_modules)) == (4, 8, list(lora.DEFAULT_TARGETS))
    assert m.lora_adapter_path is None and m.path == str(model_dir.resolve())
    assert list(full.actor.checkpoint.save_contents) == ["model", "optimizer", "extra"]  # not hf_model
    assert full.actor.checkpoint.save_lora_only is True
    # a saved adapter continues on its base (peft recorded it), with its own rank
    resumed = build_actor_config(adapter_dir, VerlEngineConfig()).actor_rollout_ref.model
    assert resumed.path == str(model_dir.resolve()) and resumed.lora_adapter_path == str(adapter_dir.resolve())
    assert resumed.lora_rank == 4
    plain = build_actor_config(model_dir, VerlEngineConfig()).actor_rollout_ref
    assert plain.model.lora_rank == 0 and list(plain.actor.checkpoint.save_contents) == ["hf_model"]
    with pytest.raises(ValueError, match="dropout"):
        build_actor_config(model_dir, VerlEngineConfig(lora=lora.AdapterConfig(dropout=0.1)))


def test_verls_state_resumes_only_on_the_world_size_it_was_saved_on(tmp_path, caplog):
    from trainer_backend.engines import verl_lora

    assert verl_lora.resumable_state(tmp_path, 1) is None  # no state: a new optimizer, silently
    (tmp_path / "verl_state").mkdir()
    (tmp_path / "verl_state" / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
    assert verl_lora.resumable_state(tmp_path, 2) == tmp_path / "verl_state"
    with caplog.at_level("WARNING"):
        assert verl_lora.resumable_state(tmp_path, 4) is None  # the shards are per rank: they do not fit
    assert "saved on 2 ranks" in caplog.text and "optimizer starts fresh" in caplog.text


# ---------------------------------------------------------------- verl's actor with LoRA


@pytest.mark.slow
def test_only_the_adapter_trains_and_the_base_stays_bit_identical(verl_run):
    out, _ = verl_run
    step = out["same_init"]
    assert len(step["trainable"]) == N_ADAPTER_TENSORS and all("lora_" in n for n in step["trainable"])
    assert step["n_base"] > 0 and step["base_changed"] == []  # torch.equal on every base tensor after the step
    assert max(float(g.abs().max()) for g in step["grads"].values()) > 1e-3  # the adapter did move
    assert out["fresh"]["trainable"] == step["trainable"]
    assert out["fresh"]["b_zero_at_start"]  # verl's get_peft_model: peft's init, B = 0 (the base exactly)


@pytest.mark.slow
def test_loss_and_gradient_equal_the_torch_engines_lora(verl_run, adapter_dir, rows):
    """Same adapter, same rows, SGD lr 1 on both (the change is minus the gradient). Tolerance: loss 1e-6,
    gradients atol 1e-5 / rtol 1e-4, as for full weights: both are fp32 with the same math, but verl sums
    per micro-batch in its unpadded layout and the torch engine over padded batches (another order of sums)."""
    out, _ = verl_run
    eng = TorchEngine(adapter_dir, TorchEngineConfig(precision="fp32", grad_clip=None, lora=ADAPTER,
                                                     loss=LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=None)))
    eng.optimizer = torch.optim.SGD(eng.params, lr=1.0)
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters() if p.requires_grad}
    metrics = eng.step(rows)
    t_grads = {n: before[n] - p.detach() for n, p in eng.model.named_parameters() if p.requires_grad}
    v = out["same_init"]
    assert v["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert set(v["grads"]) == set(t_grads)  # the same peft parameter names on both engines
    for n, g in t_grads.items():
        assert torch.allclose(v["grads"][n], g, atol=1e-5, rtol=1e-4), n
    assert min(float(g.abs().max()) for g in t_grads.values()) > 0  # A and B both get gradients (B != 0)


@pytest.mark.slow
def test_the_published_adapter_loads_with_peft_and_changes_the_models_output(verl_run, model_dir, tmp_path):
    out, run_dir = verl_run
    fresh = run_dir / "fresh"
    assert {"adapter_model.safetensors", "adapter_config.json", "verl_state"} <= set(out["fresh"]["saved"])
    assert "model.safetensors" not in out["fresh"]["saved"]  # an adapter, not full weights
    cfg = json.loads((fresh / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (4, 8) and lora.base_of(fresh) == model_dir.resolve()
    # the same files the torch engine's LoRA publishes (what the publisher loads into vLLM in place)
    torch_eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lora=ADAPTER))
    torch_eng.save(tmp_path / "torch_adapter")
    from safetensors.torch import load_file

    assert set(load_file(fresh / "adapter_model.safetensors")) == set(
        load_file(tmp_path / "torch_adapter" / "adapter_model.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tuned = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), str(fresh)).eval()
    # One AdamW step from peft's B = 0 moves every B by ~lr (0.05): the model's distribution moves
    # (measured max |d log p| 0.54), while an adapter published untrained (B = 0) would be exactly the
    # base. Whether three greedy continuations flip after one step depends on the random A and was
    # flaky (one failure in a suite run); the serving test checks greedy output after 15 steps on vLLM.
    prompts = torch.tensor([[5, 17, 42, 9, 7], [3, 3, 8, 21, 30], [40, 2, 11, 6, 19]])
    with torch.no_grad():
        moved = (base(prompts).logits.log_softmax(-1) - tuned(input_ids=prompts).logits.log_softmax(-1)).abs().max()
    assert float(moved) > 0.01, f"the trained adapter barely changes the model (max |d log p| {float(moved):.2e})"
    # and the torch engine can continue it (same folder format, base found from the adapter's config)
    assert TorchEngine(fresh, TorchEngineConfig(precision="fp32")).is_lora


@pytest.mark.slow
def test_resume_keeps_the_adapter_and_the_optimizer_state(verl_run):
    res = verl_run[0]["resume"]
    assert res["resumed_flag"] and not res["no_state_flag"]
    for n, w in res["after_first"].items():
        assert torch.equal(res["at_load"][n], w), n  # the adapter comes back exactly
    for n, w in res["continuous"].items():
        assert torch.allclose(res["resumed"][n], w, atol=1e-7, rtol=0), n  # the same AdamW second step
    # without the optimizer state the second AdamW step differs: the test can tell the two apart
    gap = max(float((res["no_state"][n] - w).abs().max()) for n, w in res["continuous"].items())
    assert gap > 1e-4
