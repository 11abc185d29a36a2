"""The warm starts' SFT step (trainer_backend/demo/sft.py): the masked-token loss computed cheaply
equals the padded batch's `labels` loss, gradients included; and the threads the loop runs on."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest


@pytest.mark.parametrize("prefixed", [False, True], ids=["row-by-row", "shared-prefix"])
@pytest.mark.parametrize("lora", [False, True])
def test_the_warm_starts_backward_equals_the_padded_batchs(lora: bool, prefixed: bool) -> None:
    """backward_batch: logits only where the loss reads them, and either the rows one at a time or
    their common prefix decoded once; the same loss and gradients as the padded batch's `labels`
    loss, over masks that start at the first token (which nothing predicts), end at the last, sit
    inside the shared prefix or on the first token after it, or leave an example nothing to learn."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from trainer_backend.demo.sft import backward_batch, length_groups, padded_batch_loss, shared_prefix

    def fresh() -> Any:
        torch.manual_seed(0)
        cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
        if lora:
            from peft import get_peft_model

            from trainer_backend.engines.lora import AdapterConfig, peft_config
            model = get_peft_model(model, peft_config(AdapterConfig(rank=4, alpha=8)))
            for name, p in model.named_parameters():  # LoRA's B starts at zero: make its A's gradient nonzero
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.1)
        return model

    g = torch.Generator().manual_seed(1)
    head = torch.randint(0, 97, (20,), generator=g).tolist() if prefixed else []

    def example(n: int, masked: list[int]) -> tuple[list[int], list[int]]:
        ids = head + torch.randint(0, 97, (n - len(head),), generator=g).tolist()
        return ids, [int(i in masked) for i in range(n)]

    if prefixed:  # 20 shared tokens, 1-8 of each row's own, and two rows of 38-40: two groups
        batch = [example(28, [0, 5, 20, 21, 27]),  # inside the prefix, the first own token, the last
                 example(60, [30, 59]),
                 example(23, [22]),
                 example(25, [0]),  # nothing after its first token: no loss, no gradient of its own
                 example(21, [20]),
                 example(58, [20, 57])]
    else:
        batch = [example(23, [0, 1, 2, 20, 21, 22]),
                 example(9, [4, 5]),
                 example(31, [0]),
                 example(17, list(range(10, 17)))]
    assert shared_prefix(batch) == (20 if prefixed else 0)
    if prefixed:
        assert length_groups([len(x) for x, _ in batch], 20)[1] == [[4, 2, 3, 0], [5, 1]]
    ref_model, model = fresh(), fresh()
    reference = padded_batch_loss(ref_model, batch)
    reference.backward()
    got = backward_batch(model, batch)
    assert got == pytest.approx(float(reference.item()), rel=1e-5)
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True)
             if p.requires_grad]
    assert grads and all(a is not None and b is not None for _, a, b in grads)
    for name, a, b in grads:
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="no example"):
        backward_batch(model, [example(25, [0]), example(24, [])])


def test_a_shared_prefix_is_decoded_once_only_where_it_computes_less() -> None:
    from trainer_backend.demo.sft import shared_prefix

    def rows(*seqs: list[int]) -> list[tuple[list[int], list[int]]]:
        return [(s, [1] * len(s)) for s in seqs]

    assert shared_prefix(rows([1, 2, 3, 4, 5], [1, 2, 3, 9])) == 3  # 3 + 2 x 2 = 7 tokens against 9
    assert shared_prefix(rows([1, 2, 3], [1, 2, 3, 4])) == 2  # each row keeps a token of its own
    assert shared_prefix(rows([1, 2, 3])) == 0  # one row: nothing to share
    # one group 1 + 2 x 6 = 13 tokens, two (1 + 1) + (1 + 6) = 9, against 9
    assert shared_prefix(rows([1, 9, 9, 9, 9, 9, 9], [1, 2])) == 0
    assert shared_prefix(rows([5, 2], [1, 2])) == 0
    # one group 3 + 3 x 7 = 24 tokens against 18; the short rows apart, (3 + 2 x 1) + (3 + 7) = 15
    assert shared_prefix(rows([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6, 7, 8, 9, 10, 11, 12])) == 3


def test_length_groups_compute_the_fewest_tokens() -> None:
    """Against every way of cutting the rows sorted by length (the optimum is one of them)."""
    import itertools
    import random

    from trainer_backend.demo.sft import length_groups

    def cost(groups: list[list[int]], lengths: list[int], shared: int) -> int:
        return sum(shared + len(g) * (max(lengths[i] for i in g) - shared) for g in groups)

    rng = random.Random(0)
    for _ in range(300):
        shared = rng.randint(1, 150)
        lengths = [shared + rng.choice([rng.randint(1, 8), rng.randint(30, 45), rng.randint(100, 111)])
                   for _ in range(rng.randint(1, 9))]
        tokens, groups = length_groups(lengths, shared)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert tokens == cost(groups, lengths, shared)
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        best = min(cost([order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))], lengths, shared)
                   for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
        assert tokens == best
    assert length_groups([130, 130, 130], 122) == (122 + 3 * 8, [[0, 1, 2]])  # equal costs: fewest groups
    # the guessing game's four lengths, 8 rows each: one group each (4 prefixes; 1,010 tokens padded)
    lengths = [128, 162, 197, 232] * 8
    tokens, groups = length_groups(lengths, 122)
    assert [sorted({lengths[i] for i in g}) for g in groups] == [[128], [162], [197], [232]]
    assert tokens == 4 * 122 + 8 * (6 + 40 + 75 + 110) < 122 + 32 * 110


@pytest.mark.parametrize(("jiffies", "idle", "own_s", "want"), [
    (400, 200, 2.0, 2.0),  # we kept one core busy, the other sat idle: both are ours
    (400, 0, 2.0, 1.0),  # we kept one busy, another process the other
    (400, 0, 2.6, 1.3),  # our two threads took 1.3 cores against a busy neighbour's 0.7
    (400, 400, 0.0, 2.0),  # all idle
    (400, 0, 0.0, 0.0),  # both cores someone else's
    (400, 300, 2.0, 2.0),  # our CPU time over the busy share (sampling skew): never more than all
])
def test_free_cores_counts_this_process_as_free(jiffies: int, idle: int, own_s: float, want: float) -> None:
    from trainer_backend.demo.sft import free_cores

    assert free_cores(2, jiffies, idle, own_s, 2.0) == pytest.approx(want)


def test_core_share_sizes_torch_threads_and_holds_a_fixed_count() -> None:
    torch = pytest.importorskip("torch")
    from trainer_backend.demo.sft import CoreShare, idle_cores

    before = torch.get_num_threads()
    try:
        fixed = CoreShare(threads=3, every_s=0.0)
        assert fixed.start() == 3 == torch.get_num_threads()
        assert fixed.step() == 3 == torch.get_num_threads()  # fixed: never read again
        n = os.cpu_count() or 1
        assert 1 <= idle_cores(0.05) <= n
        share = CoreShare(every_s=0.0)
        first = share.start()
        assert 1 <= first <= n and torch.get_num_threads() == first
        end = time.process_time() + 0.2
        while time.process_time() < end:  # our own busy time is not another process's
            pass
        again = share.step()
        assert 1 <= again <= n and torch.get_num_threads() == again
        slow = CoreShare(every_s=3600.0)
        slow.start()
        torch.set_num_threads(5)
        assert slow.step() == slow.threads and torch.get_num_threads() == 5  # not read again before every_s
    finally:
        torch.set_num_threads(before)
