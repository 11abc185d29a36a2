"""Several LoRA policies on the verl engine: one verl LoRA engine per policy (engines/verl_policies.py), on CPU.

Two policies on verl 0.9.1's real actor in one CPU process (tests/trainer/verl_cpu_policies.py, one subprocess
for the module), driven by `VerlPolicySet`'s own __init__, step and save; compared with the torch engine's
`PolicySet` on the same adapters and rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
from trainer_backend.engines.policies import PolicySet  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngineConfig  # noqa: E402

ADAPTER = lora.AdapterConfig(rank=4, alpha=8)  # the helper's
NAMES = ("coder", "reviewer")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_verl_policies"), vocab=VOCAB)


@pytest.fixture(scope="module")
def start_dir(model_dir, tmp_path_factory) -> Path:
    """A checkpoint of both policies, adapters with B != 0 (peft's B = 0 would make the loss the base's and give A
    no gradient) and different per policy: the same start for both engines."""
    out = tmp_path_factory.mktemp("start")
    for seed, name in enumerate(NAMES):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir.resolve(), dtype=torch.float32)
        torch.manual_seed(20 + seed)
        model = peft.get_peft_model(base, lora.peft_config(ADAPTER))
        g = torch.Generator().manual_seed(30 + seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        model.save_pretrained(out / name)
    return out


@pytest.fixture(scope="module")
def rows(model_dir) -> dict:
    """mixed: rollouts a, b (task t1) are the coder's, c, d (t2) the reviewer's; coder_only: the coder's rows and
    rows of a model that is no policy (left out: there is no default policy)."""
    base = perturbed_rows(model_dir, multi_turn_rows())
    mixed = [dataclasses.replace(r, policy="coder" if r.task_id == "t1" else "reviewer") for r in base]
    other = [dataclasses.replace(r, policy="someone-else") for r in base if r.task_id == "t2"]
    return {"mixed": mixed, "coder_only": [r for r in mixed if r.policy == "coder"] + other}


@pytest.fixture(scope="module")
def verl_run(model_dir, start_dir, rows, tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_policies_run")
    torch.save(rows, out / "rows.pt")
    run_verl_helper("verl_cpu_policies.py", [str(model_dir), str(start_dir), str(out / "rows.pt"), str(out)], 900)
    return torch.load(out / "out.pt", weights_only=False), out


def _split(p: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return {n: t for n, t in p.items() if "lora_" in n}, {n: t for n, t in p.items() if "lora_" not in n}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
def test_each_policy_trains_only_on_its_own_rows(verl_run):
    run = verl_run[0]["run"]
    first, _, third = run["metrics"]
    assert first["policies_updated"] == 2 and first["coder/rows"] == 3 and first["reviewer/rows"] == 2
    assert first["rows_unrouted"] == 0 and first["rows"] == 5
    # step 3: the coder's rows and two of a model that is no policy (counted, left out)
    assert third["policies_updated"] == 1 and "reviewer/rows" not in third and third["rows_unrouted"] == 2
    assert third["coder/updates"] == 3 and run["version"] == 3 and third["policy_version"] == 3
    before, after = run["after_2"], run["after_3"]
    coder_adapter, coder_base = _split(after["coder"])
    assert not _equal(coder_adapter, _split(before["coder"])[0])  # the coder trained
    assert _equal(coder_base, _split(before["coder"])[1])  # on a frozen base
    assert _equal(after["reviewer"], before["reviewer"])  # the reviewer's adapter and base: bit-identical
    assert len(coder_adapter) == 2 * 7 * 2  # 2 layers x 7 linear layers x (A, B): verl's own peft adapter
    # each policy is its own engine: its own copy of the base (the cost, docs/policies.md)
    assert _equal(_split(run["at_start"]["coder"])[1], _split(run["at_start"]["reviewer"])[1])


@pytest.mark.slow
def test_each_policys_loss_equals_the_torch_policy_sets(verl_run, start_dir, rows):
    """The same adapters and rows: each policy's loss on its rows as the torch engine's PolicySet computes it.
    Tolerance 1e-6 (both fp32 with the same math; verl sums per micro-batch in its own layout, another order of
    sums), as for one policy (test_engine_verl_lora.py)."""
    torch_set = PolicySet(start_dir, NAMES, TorchEngineConfig(
        precision="fp32", grad_clip=None, lora=ADAPTER, loss=LossConfig(clip_low=0.2, clip_high=0.28,
                                                                        dual_clip_c=None)))
    expected = torch_set.step(rows["mixed"])
    got = verl_run[0]["run"]["metrics"][0]
    for name in NAMES:
        assert got[f"{name}/loss"] == pytest.approx(expected[f"{name}/loss"], abs=1e-6), name
    assert abs(expected["coder/loss"] - expected["reviewer/loss"]) > 1e-3  # two different policies' losses


@pytest.mark.slow
def test_save_writes_both_adapters_loadable_by_peft(verl_run, model_dir):
    _, out = verl_run
    prompts = torch.tensor([[5, 17, 42, 9, 7], [3, 3, 8, 21, 30]])
    logits = {}
    for name in NAMES:
        folder = out / "c1" / name
        assert {"adapter_model.safetensors", "adapter_config.json", "verl_state"} <= set(os.listdir(folder))
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
        assert lora.base_of(folder) == model_dir.resolve()
        tuned = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), str(folder)).eval()
        with torch.no_grad():
            logits[name] = tuned(input_ids=prompts).logits
    assert float((logits["coder"] - logits["reviewer"]).abs().max()) > 1e-3  # two adapters, not one saved twice


@pytest.mark.slow
def test_resume_restores_both_adapters_and_both_optimizers(verl_run):
    res, run = verl_run[0]["resume"], verl_run[0]["run"]
    assert res["resumed"] == {"coder": True, "reviewer": True}  # verl's optimizer state found for each
    for name in NAMES:
        assert _equal(_split(res["at_load"][name])[0], _split(run["after_1"][name])[0]), name
        resumed, continuous = _split(res["after_2"][name])[0], _split(run["after_2"][name])[0]
        for n, w in continuous.items():  # the second AdamW step of each policy, as if never interrupted
            assert torch.allclose(resumed[n], w, atol=1e-7, rtol=0), (name, n)
    assert res["metrics"]["coder/updates"] == 2 and res["metrics"]["policy_version"] == 2
