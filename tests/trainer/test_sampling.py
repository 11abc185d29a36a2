"""Log-probs of the distribution that was sampled: temperature, top-k, top-p as vLLM applies them,
carried per token from each call's request into the rows."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from lightning_middleware.records import LLMCall  # noqa: E402
from lightning_middleware.rows import build_rows, sampling_of  # noqa: E402
from trainer_backend.algorithms.logprobs import MASKED, sampled_logits  # noqa: E402


def test_temperature_divides_the_logits():
    z = torch.tensor([[2.0, 1.0, 0.0]])
    out = sampled_logits(z, torch.tensor([0.5]))
    assert torch.allclose(out, z / 0.5)


def test_top_k_keeps_the_k_largest_and_ties_at_the_threshold():
    z = torch.tensor([[3.0, 1.0, 2.0, 1.0, 0.0]])
    out = sampled_logits(z, None, top_k=torch.tensor([2]))
    assert out[0].tolist() == [3.0, MASKED, 2.0, MASKED, MASKED]
    tie = sampled_logits(z, None, top_k=torch.tensor([3]))  # the 3rd largest is a tie: both ones stay
    assert tie[0].tolist() == [3.0, 1.0, 2.0, 1.0, MASKED]
    assert torch.equal(sampled_logits(z, None, top_k=torch.tensor([0])), z)  # 0: off


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_one():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    z = probs.log().unsqueeze(0)
    kept = sampled_logits(z, None, top_p=torch.tensor([0.75]))  # 0.5 + 0.3 >= 0.75: two tokens
    assert (kept[0] > MASKED / 2).tolist() == [True, True, False, False]
    one = sampled_logits(z, None, top_p=torch.tensor([0.01]))
    assert (one[0] > MASKED / 2).tolist() == [True, False, False, False]
    assert torch.equal(sampled_logits(z, None, top_p=torch.tensor([1.0])), z)
    renorm = torch.log_softmax(kept, -1)[0, :2].exp()
    assert renorm.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])


def test_gradients_flow_through_kept_logits_only_and_stay_finite():
    z = torch.tensor([[2.0, 1.0, 0.5, -1.0]], requires_grad=True)
    out = sampled_logits(z, torch.tensor([0.7]), top_k=torch.tensor([2]))
    logp = torch.log_softmax(out, -1)[0, 0]
    ent = -(torch.softmax(out, -1) * torch.log_softmax(out, -1)).sum()
    (logp + ent).backward()
    assert torch.isfinite(z.grad).all() and z.grad[0, 2:].abs().max() == 0


def _call(i, prompt, completion, **request) -> LLMCall:
    return LLMCall(id=f"c{i}", rollout_id="r", call_index=i, prompt_token_ids=tuple(prompt),
                   completion_token_ids=tuple(completion), logprobs=tuple([-0.5] * len(completion)),
                   is_training=True, request=request)


def test_sampling_parameters_come_from_each_call_and_ride_on_its_tokens():
    assert sampling_of(_call(0, [1], [2])) == (1.0, 1.0, 0)  # the API defaults
    assert sampling_of(_call(0, [1], [2], temperature=0)) == (1.0, 1.0, 0)  # greedy: vLLM's raw log-probs
    assert sampling_of(_call(0, [1], [2], temperature=0.7, top_p=0.9, top_k=20)) == (0.7, 0.9, 20)
    assert sampling_of(_call(0, [1], [2], temperature="bad", top_p=None)) == (1.0, 1.0, 0)
    [plain], _ = build_rows([_call(0, [1, 2], [3])], rollout_id="r")
    assert plain.temperature is None and plain.top_p is None and plain.top_k is None  # the fast path
    c0 = _call(0, [1, 2], [3, 4], temperature=0.7)
    c1 = _call(1, [1, 2, 3, 4, 9], [5], temperature=1.0, top_p=0.9)  # merged into the same row
    [row], _ = build_rows([c0, c1], rollout_id="r")
    assert row.input_ids == (1, 2, 3, 4, 9, 5)
    assert row.temperature == (1.0, 1.0, 0.7, 0.7, 1.0, 1.0)
    assert row.top_p == (1.0, 1.0, 1.0, 1.0, 1.0, 0.9) and row.top_k is None


def test_the_engine_trains_at_the_sampled_temperature(tmp_path):
    """The same tokens at temperature 0.5 get the log-probs of softmax(z / 0.5)."""
    import dataclasses

    from tests.trainer.tiny_models import save_tiny_qwen2
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    model = save_tiny_qwen2(tmp_path / "m", vocab=32)
    eng = TorchEngine(model, TorchEngineConfig(precision="fp32"))
    [row], _ = build_rows([_call(0, [1, 2, 3], [4, 5])], rollout_id="r")
    hot = dataclasses.replace(row, temperature=(1.0, 1.0, 1.0, 0.5, 0.5))
    [at1], [at05] = eng.token_logprobs([row]), eng.token_logprobs([hot])
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([row.input_ids])).logits[0].float()
    for t, (a, b) in enumerate(zip(at1, at05)):
        if t < 3:
            assert a == b == 0.0
            continue
        z = logits[t - 1]
        assert a == pytest.approx(float(torch.log_softmax(z, -1)[row.input_ids[t]]), abs=1e-5)
        assert b == pytest.approx(float(torch.log_softmax(z / 0.5, -1)[row.input_ids[t]]), abs=1e-5)
    assert not math.isclose(at1[3], at05[3])
