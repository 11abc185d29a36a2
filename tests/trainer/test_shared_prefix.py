"""Shared prefixes (engines/batching.py plan_micro_batches, torch_engine.decode_shared_prefixes):
rows that start alike are decoded once up to where they differ; the plan covers every row once
within the token budget, and the engine's log-probs, loss and every gradient are those of the
plain padded forward, on the token/mask edge cases."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lightning_middleware.rows import Row  # noqa: E402
from tests.trainer.test_head import sgd_step  # noqa: E402
from tests.trainer.tiny_models import save_tiny_qwen2  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.engines.batching import (  # noqa: E402
    CALL_COST,
    Plan,
    common_prefix,
    make_micro_batch,
    plan_micro_batches,
    split_micro_batches,
)
from trainer_backend.engines.lora import AdapterConfig  # noqa: E402
from trainer_backend.engines.torch_engine import decode_shared_prefixes  # noqa: E402

VOCAB = 96

# ---------------------------------------------------------------- the plan


def covered(plans) -> list[int]:
    return sorted(i for p in plans for i in p.index)


def test_a_group_shares_its_prompt():
    prompt = list(range(40))
    rows = [prompt + [50, 51], prompt + [60], prompt + [70, 71, 72], prompt + [80]]
    (plan,) = plan_micro_batches(rows, 10_000)
    assert plan.index == (0, 1, 2, 3)
    (group,) = plan.shared
    assert group.rows == (0, 1, 2, 3) and group.length == 40
    assert plan.tokens == 40 + 4 * 3 + CALL_COST  # the prompt once, each row's own tokens padded to 3


def test_two_groups_keep_their_own_prompts_rather_than_the_part_all_share():
    """Four rows share a 30-token system prompt, two and two a 90-token one: two groups of 90,
    not one of 30."""
    system = list(range(30))
    a, b = system + [1] * 60, system + [2] * 60
    rows = [a + [5], b + [6], a + [7, 8], b + [9]]
    (plan,) = plan_micro_batches(rows, 10_000)
    assert sorted((g.rows, g.length) for g in plan.shared) == [((0, 2), 90), ((1, 3), 90)]


def test_identical_rows_and_a_row_that_is_anothers_prefix_keep_a_token_of_their_own():
    rows = [list(range(50)), list(range(50)), list(range(45))]
    (plan,) = plan_micro_batches(rows, 10_000)
    (group,) = plan.shared
    assert group.rows == (0, 1, 2) and group.length == 44  # the shortest row minus its last token
    rows[2] = list(range(30))  # 29 + 3 x 21 + CALL_COST > 49 + 2 + CALL_COST + 30: the short row goes alone
    (plan,) = plan_micro_batches(rows, 10_000)
    assert [(g.rows, g.length) for g in plan.shared] == [((0, 1), 49)]
    rows = [list(range(50)), list(range(50))]
    assert plan_micro_batches(rows, 10_000)[0].shared[0].length == 49


def test_little_in_common_is_not_worth_two_more_calls():
    rows = [[1, 2, 3, 4, 10 + i] + [i] * 30 for i in range(4)]  # 4 tokens shared: 12 saved < CALL_COST
    plans = plan_micro_batches(rows, 10_000)
    assert [p.shared for p in plans] == [()]
    assert plans[0].index == (0, 1, 2, 3)


def test_without_shared_prefixes_the_plan_is_the_padded_split():
    lengths = [10, 3, 7, 5, 9]
    rows = [[100 * i + k for k in range(n)] for i, n in enumerate(lengths)]
    for budget in (1, 10, 20, 30, 1000):
        plans = plan_micro_batches(rows, budget)
        assert [list(p.index) for p in plans] == split_micro_batches(lengths, budget)
        assert all(p.shared == () for p in plans)
        assert plan_micro_batches(rows, budget, share=False) == plans


def test_a_group_over_the_budget_is_cut_into_groups_on_the_same_prompt():
    prompt = list(range(40))
    rows = [prompt + [50 + i] * 10 for i in range(8)]
    budget = 40 + 4 * 10 + CALL_COST  # four rows on the prompt
    plans = plan_micro_batches(rows, budget)
    assert covered(plans) == list(range(8))
    assert all(p.tokens <= budget for p in plans)
    assert [len(g.rows) for p in plans for g in p.shared] == [4, 4]
    assert all(g.length == 40 for p in plans for g in p.shared)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=0, max_size=12),
       st.integers(1, 200), st.integers(0, 40))
def test_any_plan_covers_each_row_once_and_its_groups_truly_share(rows, budget, call_cost):
    plans = plan_micro_batches(rows, budget, call_cost=call_cost)
    assert covered(plans) == list(range(len(rows)))
    for p in plans:
        for g in p.shared:
            assert len(g.rows) >= 2 and set(g.rows) <= set(p.index)
            assert 1 <= g.length < min(len(rows[i]) for i in g.rows)
            assert all(common_prefix(rows[g.rows[0]], rows[i]) >= g.length for i in g.rows)
        # Over the budget only when it can't be helped: one row, or one group that fits no smaller.
        if p.tokens > budget:
            assert len(p.index) == 1
        assert p.tokens >= sum(g.length for g in p.shared)
    assert plan_micro_batches(rows, budget, share=False) == [
        Plan(tuple(ix), (), len(ix) * max(len(rows[i]) for i in ix))
        for ix in split_micro_batches([len(r) for r in rows], budget)]


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_shared"), vocab=VOCAB)


def grouped_rows() -> list[Row]:
    """Two GRPO groups on their own prompts; in the first, two identical rows and one row whose
    completion starts as another's (a longer common prefix); a multi-turn rollout whose trained
    first turn lies inside the prefix its second row shares; a row that is all of another
    row but its last token; a lone row; temperature and top-k on some tokens."""
    g = torch.Generator().manual_seed(5)

    def ids(n):
        return tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())

    p1, p2, c, c2 = ids(40), ids(33), ids(6), ids(9)
    turn, reply = ids(40), ids(12)
    specs = [  # (tokens, trained from, advantage, temperature, top_k)
        (p1 + c, 40, 1.0, None, None),
        (p1 + c, 40, -1.0, None, None),
        (p1 + c[:3] + ids(5), 40, 0.5, 0.7, 5),
        (p1 + ids(2), 40, -0.5, None, None),
        (p2 + c2, 33, 1.5, None, 7),
        (p2 + ids(1), 33, -1.5, 1.3, None),
        (p2 + c2[:-1], 33, 0.25, None, None),
        (turn + reply, 10, 1.0, None, None),  # trained tokens 10..: inside the part it shares with the next row
        (turn + reply[:4] + ids(3), 10, 1.0, None, None),
        (ids(17), 5, -1.0, None, None),
    ]
    rows = []
    for i, (tokens, start, adv, temp, top_k) in enumerate(specs):
        n = len(tokens)
        mask = tuple(int(k >= start) for k in range(n))
        rows.append(Row(rollout_id=f"r{i}", task_id=f"t{i // 4}", agent=None, input_ids=tokens, loss_mask=mask,
                        behaviour_logprobs=tuple(-1.5 * m for m in mask), advantage=adv,
                        temperature=None if temp is None else (temp,) * n,
                        top_k=None if top_k is None else (top_k,) * n))
    return rows


def assert_same_step(a, b, *, keys=("loss", "pg_loss", "entropy", "grad_norm", "approx_kl", "clip_frac")):
    (m1, lp1, g1), (m2, lp2, g2) = a, b
    for x, y in zip(lp1, lp2):
        assert x == pytest.approx(y, abs=2e-5)
    for key in keys:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    moved = [k for k in g2 if float(g2[k].abs().max()) > 0]
    assert moved
    scale = max(float(g.abs().max()) for g in g2.values())
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-3, atol=1e-5 * scale, msg=k)


def test_the_plan_of_the_edge_cases(model_dir):
    rows = grouped_rows()
    (plan,) = plan_micro_batches([r.input_ids for r in rows], 10_000)
    groups = sorted((g.rows, g.length) for g in plan.shared)
    assert groups == [((0, 1, 2, 3), 40), ((4, 5, 6), 33), ((7, 8), 44)]  # row 9 alone


@pytest.mark.parametrize("lora", [False, True])
def test_the_engine_takes_the_same_step_with_shared_prefixes(model_dir, lora):
    """Log-probs, loss, entropy (its coefficient is on) and every gradient, tied embeddings
    included (with LoRA, the adapter's), with and without sharing; the shared step decodes fewer
    tokens."""
    rows = grouped_rows()
    extra = {"lora": AdapterConfig(rank=4, alpha=8)} if lora else {}
    shared = sgd_step(model_dir, rows, **extra)
    plain = sgd_step(model_dir, rows, share_prefixes=False, **extra)
    assert_same_step(shared, plain)
    assert shared[0]["decoded_tokens"] < 0.6 * plain[0]["decoded_tokens"]
    assert plain[0]["decoded_tokens"] == plain[0]["padded_tokens"]


def test_a_kl_reference_and_recomputed_old_logprobs_share_too(model_dir):
    """The frozen reference's forward and the no-grad recompute run on the same plan."""
    rows = grouped_rows()
    loss = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    shared = sgd_step(model_dir, rows, loss=loss, old_logprobs="recompute")
    plain = sgd_step(model_dir, rows, loss=loss, old_logprobs="recompute", share_prefixes=False)
    assert_same_step(shared, plain, keys=("loss", "pg_loss", "kl_ref", "grad_norm", "approx_kl"))


def test_a_small_budget_cuts_groups_and_keeps_the_step(model_dir):
    rows = grouped_rows()
    small = sgd_step(model_dir, rows, micro_batch_tokens=120)  # a group and its prompt per micro-batch
    plain = sgd_step(model_dir, rows, share_prefixes=False)
    assert small[0]["micro_batches"] == 3  # the lone row rides with a group
    assert small[0]["decoded_tokens"] < plain[0]["decoded_tokens"]
    assert_same_step(small, plain)


@pytest.mark.parametrize("option", ["gradient_checkpointing", "compile"])
def test_checkpointed_or_compiled_layers_decode_every_row_whole(model_dir, option):
    """Checkpointed layers drop their keys and values; compiled layers would need a graph per way
    of calling them. Nothing is shared then, and the step is the same."""
    rows = grouped_rows()
    other = sgd_step(model_dir, rows, **{option: True})
    assert other[0]["decoded_tokens"] == other[0]["padded_tokens"]
    assert_same_step(other, sgd_step(model_dir, rows, share_prefixes=False))


def test_decoding_with_shared_prefixes_gives_the_padded_batchs_hidden_states(model_dir):
    from transformers import AutoModelForCausalLM

    rows = grouped_rows()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    (plan,) = plan_micro_batches([r.input_ids for r in rows], 10_000)
    weights = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rows]
    mb = make_micro_batch(rows, plan.index, weights, 0, plan.shared)
    with torch.no_grad():
        plain = model.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
        shared = decode_shared_prefixes(model.model, mb.input_ids, mb.attention_mask, mb.shared)
    real = mb.attention_mask.bool()
    assert shared.shape == plain.shape
    torch.testing.assert_close(shared[real], plain[real], rtol=1e-4, atol=1e-5)
