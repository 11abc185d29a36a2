"""Token/mask edge cases of the row rule (lightning_middleware.rows). Pure Python."""

from __future__ import annotations

import itertools

import pytest

from lightning_middleware.records import Choice, LLMCall, Rollout
from lightning_middleware.rows import Row, RowStats, build_rows, build_rows_for_rollouts, with_advantages


def call(i: int, prompt, completion, *, lp=None, agent=None, attempt=1, training=True, partial=False,
         version=None, default_lp=True) -> LLMCall:
    if lp is None and default_lp:
        lp = tuple(-0.1 * (k + 1) for k in range(len(completion)))
    return LLMCall(id=f"c{i}.{attempt}.{agent}", rollout_id="r1", call_index=i, attempt=attempt,
                   agent_name=agent, prompt_token_ids=tuple(prompt), completion_token_ids=tuple(completion),
                   logprobs=lp, is_training=training, partial=partial, policy_version=version)


def rows_of(calls, max_len=None):
    return build_rows(calls, rollout_id="r1", task_id="t1", max_len=max_len)


def test_single_call():
    rows, st = rows_of([call(0, [1, 2, 3], [4, 5], version=3)])
    assert len(rows) == 1
    r = rows[0]
    assert r.input_ids == (1, 2, 3, 4, 5)
    assert r.loss_mask == (0, 0, 0, 1, 1)
    assert r.behaviour_logprobs == pytest.approx((0, 0, 0, -0.1, -0.2))
    assert (r.rollout_id, r.task_id, r.agent, r.policy_version, r.advantage) == ("r1", "t1", None, 3, 0.0)
    assert r.n_response_tokens == 2 and len(r) == 5
    assert st.calls_used == 1 and st.rows == 1 and st.merges == 0 and st.prefix_breaks == 0
    assert st.prefix_break_rate == 0.0 and st.response_tokens == 2 and st.total_tokens == 5


def test_merge_three_turns_with_observations():
    c0 = call(0, [1, 2], [10, 11], version=1)
    c1 = call(1, [1, 2, 10, 11, 20, 21, 22], [12], version=2)  # observation 20 21 22
    c2 = call(2, [1, 2, 10, 11, 20, 21, 22, 12, 30], [13, 14], version=2)
    rows, st = rows_of([c0, c1, c2])
    assert len(rows) == 1
    r = rows[0]
    assert r.input_ids == (1, 2, 10, 11, 20, 21, 22, 12, 30, 13, 14)
    assert r.loss_mask == (0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1)
    assert r.behaviour_logprobs == pytest.approx((0, 0, -0.1, -0.2, 0, 0, 0, -0.1, 0, -0.1, -0.2))
    assert r.call_ids == ("c0.1.None", "c1.1.None", "c2.1.None")
    assert r.policy_version == 1  # oldest
    assert st.merges == 2 and st.prefix_breaks == 0 and st.rows == 1


def test_merge_with_no_observation_between():
    rows, st = rows_of([call(0, [1], [2]), call(1, [1, 2], [3])])
    assert rows[0].input_ids == (1, 2, 3) and rows[0].loss_mask == (0, 1, 1)
    assert st.merges == 1


def test_prefix_break_starts_new_row():
    c0 = call(0, [1, 2], [10, 11])
    c1 = call(1, [1, 2, 10, 99, 20], [12])  # re-tokenised completion: not a prefix
    c2 = call(2, [1, 2, 10, 99, 20, 12, 5], [13])  # extends the second row
    rows, st = rows_of([c0, c1, c2])
    assert [r.input_ids for r in rows] == [(1, 2, 10, 11), (1, 2, 10, 99, 20, 12, 5, 13)]
    assert rows[1].loss_mask == (0, 0, 0, 0, 0, 1, 0, 1)
    assert st.prefix_breaks == 1 and st.merges == 1 and st.prefix_break_rate == 0.5


def test_shorter_prompt_is_a_break():
    rows, st = rows_of([call(0, [1, 2, 3], [4]), call(1, [1, 2], [5])])
    assert len(rows) == 2 and st.prefix_breaks == 1


def test_two_agents_interleaved():
    a0 = call(0, [1, 2], [3], agent="planner")
    b0 = call(1, [7, 8], [9], agent="coder")
    a1 = call(2, [1, 2, 3, 4], [5], agent="planner")
    b1 = call(3, [7, 8, 9, 6], [10], agent="coder")
    rows, st = rows_of([a0, b0, a1, b1])
    assert [(r.agent, r.input_ids, r.loss_mask) for r in rows] == [
        ("planner", (1, 2, 3, 4, 5), (0, 0, 1, 0, 1)),
        ("coder", (7, 8, 9, 6, 10), (0, 0, 1, 0, 1)),
    ]
    assert st.merges == 2 and st.prefix_breaks == 0


def test_agents_do_not_merge_across_threads():
    # agent b's prompt extends agent a's row, but belongs to another thread
    rows, st = rows_of([call(0, [1], [2], agent="a"), call(1, [1, 2, 3], [4], agent="b")])
    assert len(rows) == 2 and st.merges == 0 and st.prefix_breaks == 0


def test_retried_call_uses_training_attempt_only():
    failed = call(1, [1, 2, 3, 4], [77], attempt=1, training=False)
    ok = call(1, [1, 2, 3, 4], [5], attempt=2)
    rows, st = rows_of([call(0, [1, 2], [3]), ok, failed])  # order in input does not matter
    assert rows[0].input_ids == (1, 2, 3, 4, 5)
    assert st.skipped_non_training == 1 and st.calls_used == 2 and st.calls_in == 3


def test_duplicate_training_attempts_later_wins():
    rows, st = rows_of([call(0, [1], [2], attempt=1), call(0, [1], [3], attempt=2)])
    assert rows[0].input_ids == (1, 3) and st.duplicate_attempts == 1


def test_partial_stream_skipped():
    rows, st = rows_of([call(0, [1, 2], [3]), call(1, [1, 2, 3, 4], [5, 6], partial=True, training=False)])
    assert rows[0].input_ids == (1, 2, 3)
    assert st.skipped_partial == 1 and st.skipped_non_training == 0


def test_partial_counted_even_if_marked_training():
    _, st = rows_of([call(0, [1], [2], partial=True, training=True)])
    assert st.skipped_partial == 1 and st.rows == 0


def test_call_without_token_ids_skipped():
    no_ids = call(1, [], [], default_lp=False)
    rows, st = rows_of([call(0, [1], [2]), no_ids, call(2, [1, 2, 3], [4])])
    assert st.skipped_no_token_ids == 1
    assert rows[0].input_ids == (1, 2, 3, 4) and st.merges == 1


def test_missing_or_mismatched_logprobs_make_row_recompute():
    rows, st = rows_of([call(0, [1], [2]), call(1, [1, 2, 3], [4], default_lp=False)])
    assert rows[0].behaviour_logprobs is None and st.calls_without_logprobs == 1
    rows, st = rows_of([call(0, [1], [2, 3], lp=(-0.5,))])
    assert rows[0].behaviour_logprobs is None and st.calls_without_logprobs == 1


def test_truncation_keeps_left_part():
    c0 = call(0, [1, 2], [3, 4])
    c1 = call(1, [1, 2, 3, 4, 5], [6, 7, 8])
    rows, st = rows_of([c0, c1], max_len=6)
    r = rows[0]
    assert r.input_ids == (1, 2, 3, 4, 5, 6) and r.loss_mask == (0, 0, 1, 1, 0, 1)
    assert r.behaviour_logprobs == pytest.approx((0, 0, -0.1, -0.2, 0, -0.1))
    assert r.truncated and st.truncated_rows == 1 and st.truncated_response_tokens == 2
    assert st.response_tokens == 3 and st.total_tokens == 6


def test_truncation_exact_fit_is_not_truncated():
    rows, st = rows_of([call(0, [1, 2], [3])], max_len=3)
    assert not rows[0].truncated and st.truncated_rows == 0


def test_truncation_drops_row_without_completion_left():
    rows, st = rows_of([call(0, [1, 2, 3, 4], [5, 6]), call(1, [9], [8])], max_len=4)
    assert [r.input_ids for r in rows] == [(9, 8)]
    assert st.dropped_too_long == 1 and st.truncated_rows == 1 and st.truncated_response_tokens == 2
    assert st.rows == 1 and st.prefix_breaks == 1


def test_empty_completion():
    # alone: no response token, row dropped
    rows, st = rows_of([call(0, [1, 2], [])])
    assert rows == [] and st.dropped_empty == 1 and st.calls_used == 1
    # inside a thread: adds nothing to the loss but still extends the prefix
    rows, st = rows_of([call(0, [1], [2]), call(1, [1, 2, 3], []), call(2, [1, 2, 3, 4], [5])])
    assert rows[0].input_ids == (1, 2, 3, 4, 5) and rows[0].loss_mask == (0, 1, 0, 0, 1)
    assert st.merges == 2 and rows[0].behaviour_logprobs == pytest.approx((0, -0.1, 0, 0, -0.1))


def test_no_calls():
    rows, st = rows_of([])
    assert rows == [] and st == RowStats()


def test_stats_add_and_groups_of_one():
    items = [
        (Rollout(id="r1", task_id="t1"), [call(0, [1], [2])]),
        (Rollout(id="r2", task_id="t2"), [call(0, [1], [2]), call(1, [5], [6])]),
    ]
    rows, st = build_rows_for_rollouts(items)
    assert [(r.rollout_id, r.task_id) for r in rows] == [("r1", "t1"), ("r2", "t2"), ("r2", "t2")]
    assert st.rows == 3 and st.prefix_breaks == 1 and st.calls_in == 3
    assert st.as_dict()["prefix_break_rate"] == 1.0


def test_with_advantages():
    rows, _ = rows_of([call(0, [1], [2]), call(1, [5], [6])])
    by_rollout = with_advantages(rows, {"r1": 0.5})
    assert [r.advantage for r in by_rollout] == [0.5, 0.5]
    per_row = with_advantages(rows, [1.0, -1.0])
    assert [r.advantage for r in per_row] == [1.0, -1.0]
    with pytest.raises(ValueError):
        with_advantages(rows, [1.0])
    assert isinstance(per_row[0], Row) and rows[0].advantage == 0.0


def test_rows_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, lightning_middleware.rows, lightning_middleware.records; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_one_rule_for_which_attempt_counts():
    """Per call index: the last training attempt, else the last attempt. Training, evaluation
    metrics and export all use `counted_attempts`, so they agree on which tokens a call had."""
    from lightning_middleware.rows import counted_attempts

    first = call(0, [1, 2], [3], attempt=1)
    replay = call(0, [1, 2], [3, 4], attempt=2)  # two training attempts of one call (a replayed retry)
    failed = call(0, [1, 2], [], attempt=3, training=False)  # a later failed attempt never displaces them
    only_failed = [call(1, [5], [6], attempt=1, training=False), call(1, [5], [7], attempt=2, training=False)]
    counted = counted_attempts([failed, replay, first, *only_failed])
    assert [(c.call_index, c.attempt) for c in counted] == [(0, 2), (1, 2)]
    rows, st = rows_of([first, replay, failed])
    assert rows[0].input_ids == (1, 2, 3, 4) and st.duplicate_attempts == 1  # the trainer trains the same one


def test_evaluation_metrics_count_the_attempt_the_trainer_trains(store) -> None:
    from lightning_middleware.controller import compute_metrics

    store.create_rollout(Rollout(id="r1", task_id="t1", status="succeeded"))
    for c in (call(0, [1, 2], [3], attempt=1), call(0, [1, 2], [3, 4, 5], attempt=2)):
        store.record_call(c)
    m = compute_metrics(store, ["r1"])
    # 2 prompt + 3 completion tokens: the second training attempt (the first one's 1 token before)
    assert m["tokens_per_rollout"] == 5 and m["completion_tokens_per_rollout"] == 3 and m["avg_turns"] == 1


# ---------------------------------------------------------------- calls with several choices (n > 1)


def lp_of(k: int, j: int) -> float:
    """Choice k's logprob of its token j: distinct per choice, so a test sees whose it got."""
    return -(k + 1) - 0.01 * j


def ncall(i: int, prompt, choices, *, lps=None, agent=None, attempt=1, training=True, partial=False) -> LLMCall:
    """A call answered with several choices; choice k's logprobs are `lp_of(k, j)` unless `lps[k]` says."""
    lps = lps if lps is not None else [tuple(lp_of(k, j) for j in range(len(c))) for k, c in enumerate(choices)]
    extra = tuple(Choice(k, tuple(c), lps[k], "stop") for k, c in enumerate(choices) if k > 0)
    return LLMCall(id=f"c{i}.{attempt}.{agent}", rollout_id="r1", call_index=i, attempt=attempt, agent_name=agent,
                   prompt_token_ids=tuple(prompt), completion_token_ids=tuple(choices[0]), logprobs=lps[0],
                   finish_reason="stop", is_training=training, partial=partial, extra_choices=extra)


def test_choice_1_continued_is_trained_with_its_own_logprobs():
    c0 = ncall(0, [1, 2], [[10, 11], [20, 21], [30]])
    c1 = call(1, [1, 2, 20, 21, 5], [6])  # the agent sent choice 1 back, then observation 5
    rows, st = rows_of([c0, c1])
    [r] = rows
    assert r.input_ids == (1, 2, 20, 21, 5, 6) and r.loss_mask == (0, 0, 1, 1, 0, 1)
    assert r.behaviour_logprobs == pytest.approx((0, 0, lp_of(1, 0), lp_of(1, 1), 0, -0.1))
    assert r.choices == (1, 0) and r.call_ids == ("c0.1.None", "c1.1.None")
    assert st.other_choices == 1 and st.merges == 1 and st.prefix_breaks == 0 and st.response_tokens == 3


def test_choice_0_continued():
    c0 = ncall(0, [1, 2], [[10, 11], [20, 21], [30]])
    rows, st = rows_of([c0, call(1, [1, 2, 10, 11, 5], [6])])
    assert rows[0].input_ids == (1, 2, 10, 11, 5, 6) and rows[0].choices == (0, 0)
    assert rows[0].behaviour_logprobs == pytest.approx((0, 0, lp_of(0, 0), lp_of(0, 1), 0, -0.1))
    assert st.other_choices == 0 and st.merges == 1


def test_last_choice_continued_with_nothing_between():
    c0 = ncall(0, [1, 2], [[10, 11], [20, 21], [30]])
    rows, st = rows_of([c0, call(1, [1, 2, 30], [6])])  # no observation: the next prompt is prompt + choice 2
    assert rows[0].input_ids == (1, 2, 30, 6) and rows[0].loss_mask == (0, 0, 1, 1)
    assert rows[0].behaviour_logprobs == pytest.approx((0, 0, lp_of(2, 0), -0.1)) and rows[0].choices == (2, 0)
    assert st.other_choices == 1


def test_identical_choices_train_the_lowest_index():
    both = ncall(0, [1, 2], [[10, 11], [10, 11], [30]])
    rows, _ = rows_of([both, call(1, [1, 2, 10, 11, 5], [6])])
    assert rows[0].choices == (0, 0) and rows[0].behaviour_logprobs[2:4] == pytest.approx((lp_of(0, 0), lp_of(0, 1)))
    later = ncall(0, [1, 2], [[30], [10, 11], [10, 11]])
    rows, st = rows_of([later, call(1, [1, 2, 10, 11, 5], [6])])
    assert rows[0].choices == (1, 0) and rows[0].behaviour_logprobs[2:4] == pytest.approx((lp_of(1, 0), lp_of(1, 1)))
    assert st.other_choices == 1


def test_a_choice_that_is_a_prefix_of_another_loses_to_the_longer_match():
    c0 = ncall(0, [1, 2], [[10], [10, 11]])
    rows, _ = rows_of([c0, call(1, [1, 2, 10, 11, 5], [6])])  # both match: the longer one explains more
    assert rows[0].choices == (1, 0) and rows[0].loss_mask == (0, 0, 1, 1, 0, 1)
    rows, _ = rows_of([c0, call(1, [1, 2, 10, 5], [6])])  # only choice 0 matches
    assert rows[0].choices == (0, 0) and rows[0].loss_mask == (0, 0, 1, 0, 1)


def test_an_empty_choice_matches_any_continuation_of_the_prompt():
    c0 = ncall(0, [1, 2], [[], [10]])
    rows, _ = rows_of([c0, call(1, [1, 2, 10, 5], [6])])
    assert rows[0].choices == (1, 0)
    rows, st = rows_of([c0, call(1, [1, 2, 5], [6])])
    assert rows[0].choices == (0, 0) and rows[0].input_ids == (1, 2, 5, 6) and st.merges == 1


def test_no_choice_continued_trains_choice_0_and_breaks():
    c0 = ncall(0, [1, 2], [[10, 11], [20, 21]])
    rows, st = rows_of([c0, call(1, [1, 2, 20, 99], [6])])  # re-tokenised choice 1: extends none
    assert [r.input_ids for r in rows] == [(1, 2, 10, 11), (1, 2, 20, 99, 6)]
    assert rows[0].choices == (0,) and rows[0].behaviour_logprobs == pytest.approx((0, 0, lp_of(0, 0), lp_of(0, 1)))
    assert st.prefix_breaks == 1 and st.other_choices == 0


def test_next_prompt_that_does_not_extend_the_prompt_trains_choice_0():
    c0 = ncall(0, [1, 2], [[10], [20]])
    rows, st = rows_of([c0, call(1, [1, 3, 20], [6])])
    assert rows[0].choices == (0,) and st.prefix_breaks == 1


def test_the_last_call_trains_choice_0():
    rows, st = rows_of([ncall(0, [1, 2], [[10, 11], [20, 21], [30]])])
    assert rows[0].input_ids == (1, 2, 10, 11) and rows[0].choices == (0,)
    assert rows[0].behaviour_logprobs == pytest.approx((0, 0, lp_of(0, 0), lp_of(0, 1)))
    c1 = ncall(1, [1, 2, 20, 21, 5], [[6], [7]])
    rows, st = rows_of([ncall(0, [1, 2], [[10, 11], [20, 21]]), c1])
    assert rows[0].input_ids == (1, 2, 20, 21, 5, 6) and rows[0].choices == (1, 0) and st.other_choices == 1


def test_n1_calls_are_unchanged():
    calls = [call(0, [1, 2], [10, 11]), call(1, [1, 2, 10, 11, 5], [6])]
    rows, st = rows_of(calls)
    assert calls[0].choices == (Choice(0, (10, 11), calls[0].logprobs, None),)
    assert rows[0].input_ids == (1, 2, 10, 11, 5, 6) and rows[0].choices == (0, 0) and st.other_choices == 0


def test_retry_attempt_trains_the_counted_attempts_choice():
    failed = ncall(0, [1, 2], [[40], [41]], attempt=1, training=False)
    ok = ncall(0, [1, 2], [[10, 11], [20, 21]], attempt=2)
    rows, st = rows_of([failed, ok, call(1, [1, 2, 20, 21, 5], [6])])
    assert rows[0].call_ids[0] == "c0.2.None" and rows[0].choices == (1, 0)
    assert rows[0].behaviour_logprobs[2:4] == pytest.approx((lp_of(1, 0), lp_of(1, 1)))
    # a next prompt that continues only the superseded attempt's choice 1: the counted attempt's choice 0
    rows, st = rows_of([failed, ok, call(1, [1, 2, 41, 5], [6])])
    assert rows[0].input_ids == (1, 2, 10, 11) and rows[0].choices == (0,) and st.prefix_breaks == 1
    # two training attempts: the later wins, with its own choices
    first = ncall(0, [1, 2], [[20, 21], [10, 11]], attempt=1)
    rows, st = rows_of([first, ok, call(1, [1, 2, 20, 21, 5], [6])])
    assert rows[0].call_ids[0] == "c0.2.None" and rows[0].choices == (1, 0) and st.duplicate_attempts == 1


def test_the_next_call_is_the_next_of_the_same_agent():
    a0 = ncall(0, [1, 2], [[10], [20]], agent="a")
    b0 = call(1, [1, 2, 20, 5], [7], agent="b")  # another thread: says nothing about a's choice
    a1 = call(2, [1, 2, 10, 5], [8], agent="a")
    rows, st = rows_of([a0, b0, a1])
    assert [(r.agent, r.choices) for r in rows] == [("a", (0, 0)), ("b", (0,))]
    a1 = call(2, [1, 2, 20, 5], [8], agent="a")
    rows, st = rows_of([a0, b0, a1])
    assert [(r.agent, r.choices, r.input_ids) for r in rows] == [("a", (1, 0), (1, 2, 20, 5, 8)),
                                                                 ("b", (0,), (1, 2, 20, 5, 7))]


def test_skipped_calls_do_not_decide_the_choice():
    c0 = ncall(0, [1, 2], [[10], [20]])
    partial = call(1, [1, 2, 10, 5], [6], partial=True, training=False)  # not trained: the one after decides
    rows, st = rows_of([c0, partial, call(2, [1, 2, 20, 5], [7])])
    assert rows[0].choices == (1, 0) and rows[0].input_ids == (1, 2, 20, 5, 7) and st.skipped_partial == 1


def test_logprobs_of_the_chosen_choice_decide_recomputation():
    no_lp_1 = ncall(0, [1, 2], [[10], [20]], lps=[(-0.5,), None])
    rows, st = rows_of([no_lp_1, call(1, [1, 2, 20, 5], [6])])
    assert rows[0].behaviour_logprobs is None and st.calls_without_logprobs == 1
    rows, st = rows_of([no_lp_1, call(1, [1, 2, 10, 5], [6])])
    assert rows[0].behaviour_logprobs == pytest.approx((0, 0, -0.5, 0, -0.1)) and st.calls_without_logprobs == 0
    short_lp_1 = ncall(0, [1, 2], [[10], [20, 21]], lps=[(-0.5,), (-0.7,)])  # a count not matching its tokens
    rows, st = rows_of([short_lp_1, call(1, [1, 2, 20, 21, 5], [6])])
    assert rows[0].behaviour_logprobs is None and st.calls_without_logprobs == 1


def test_truncation_cuts_the_chosen_choice():
    c0 = ncall(0, [1, 2], [[10], [20, 21, 22]])
    rows, st = rows_of([c0, call(1, [1, 2, 20, 21, 22, 5], [6])], max_len=4)
    assert rows[0].input_ids == (1, 2, 20, 21) and rows[0].choices == (1, 0)
    assert st.truncated_response_tokens == 2


def _oracle(prompt, choices, next_prompt) -> int:
    """The rule, written independently: the longest choice the next prompt continues, lowest index first."""
    best, best_len = 0, -1
    for k, c in enumerate(choices):
        if tuple(next_prompt[:len(prompt) + len(c)]) == tuple(prompt) + tuple(c) and len(c) > best_len:
            best, best_len = k, len(c)
    return best


def test_exhaustive_small_token_cases():
    """Every pair and some triples of choices of up to 2 tokens over {7, 8} against every next
    prompt tail of up to 3 tokens over {7, 8, 9}: the trained choice, its tokens, mask and logprobs."""
    seqs = [()] + [(a,) for a in (7, 8)] + [(a, b) for a in (7, 8) for b in (7, 8)]
    tails = [()] + [t for n in (1, 2, 3) for t in itertools.product((7, 8, 9), repeat=n)]
    sets = [list(p) for p in itertools.product(seqs, repeat=2)] + [[(7,), (7, 8), (8,)], [(), (), (8,)]]
    prompt = (1, 2)
    checked = 0
    for choices in sets:
        c0 = ncall(0, prompt, choices)
        for tail in tails:
            nxt = prompt + tail
            k = _oracle(prompt, choices, nxt)
            matched = any(nxt[2:2 + len(c)] == c for c in choices)
            rows, st = rows_of([c0, call(1, nxt, [5])])
            first = rows[0]
            n = len(choices[k])
            assert first.choices[0] == k, (choices, tail)
            assert first.input_ids[:2 + n] == prompt + choices[k] and first.loss_mask[:2 + n] == (0, 0) + (1,) * n
            assert first.behaviour_logprobs[2:2 + n] == pytest.approx(tuple(lp_of(k, j) for j in range(n)))
            assert (st.merges, st.prefix_breaks, st.other_choices) == (int(matched), int(not matched), int(k != 0))
            checked += 1
    assert checked == len(sets) * len(tails) == 51 * 40
