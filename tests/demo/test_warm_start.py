"""The tiny model's warm start (trainer_backend/demo/warm_start.py): its SFT's learning-rate schedule
and the curve it keeps beside the model."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from trainer_backend.demo.warm_start import WarmStartConfig

SHRUNK = WarmStartConfig(sft_steps=8, warmup_steps=2, demos=64, batch_size=4, precision="fp32", min_lr_ratio=0.1,
                         max_rounds=1)


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real build, shrunk to seconds."""
    pytest.importorskip("transformers")
    from trainer_backend.demo.warm_start import warm_start

    return warm_start(tmp_path_factory.mktemp("ws") / "ws", SHRUNK, progress=False, threads=1)


def test_the_sft_warms_up_then_decays_and_keeps_its_curve(shrunk: Path) -> None:
    """The lr each step ran at is the shared schedule's (a warm-up, then a linear decay toward
    lr * min_lr_ratio), and warm_start.json keeps every step's lr and loss."""
    from trainer_backend.engines.torch_config import schedule_factor

    cfg = SHRUNK
    kept = json.loads((shrunk / "warm_start.json").read_text())
    assert kept["lr_schedule"] == "linear" and kept["min_lr_ratio"] == 0.1 and kept["lr"] == cfg.lr
    curve = kept["curve"]
    want = [cfg.lr * schedule_factor(k, "linear", 2, 8, 0.1) for k in range(8)]
    assert curve["lr"] == pytest.approx(want)
    assert curve["lr"][:2] == pytest.approx([cfg.lr / 2, cfg.lr])  # the warm-up
    after = curve["lr"][2:]  # from the peak down
    assert all(a > b for a, b in zip(after, after[1:])) and after[-1] > 0.1 * cfg.lr  # decaying, not yet at the floor
    assert len(curve["loss"]) == 8 and all(math.isfinite(x) and x > 0 for x in curve["loss"])
    assert curve["loss"][-1] < curve["loss"][0]


def test_a_schedule_is_part_of_the_cache_key_and_a_bad_one_is_refused() -> None:
    """A build at another schedule never reuses a cached one; an unknown schedule fails in one line
    before anything is built."""
    pytest.importorskip("torch")
    assert WarmStartConfig().key() != WarmStartConfig(lr_schedule="constant").key()
    assert WarmStartConfig().key() != WarmStartConfig(min_lr_ratio=0.5).key()
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, linear, cosine, not 'step'"):
        WarmStartConfig(lr_schedule="step").resolved()


def test_guess_probs_weigh_each_call_in_the_range_given_only_what_the_agent_saw(shrunk: Path) -> None:
    """The next guess's probabilities cover LOW..HIGH and sum to 1; before any answer the context is
    the same whatever the secret, after one it is not (the answer is in the prompt, the secret never);
    `last_guesses` reports the leaves exact bisection reaches on its fourth guess."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_backend.demo.task import HIGH, LOW
    from trainer_backend.demo.warm_start import guess_probs, last_guesses

    tok = AutoTokenizer.from_pretrained(shrunk)
    model = AutoModelForCausalLM.from_pretrained(shrunk, dtype=torch.float32).eval()
    first = guess_probs(model, tok, 3, [])
    assert sorted(first) == list(range(LOW, HIGH + 1)) and sum(first.values()) == pytest.approx(1.0)
    assert all(0 < q < 1 for q in first.values())
    assert guess_probs(model, tok, 12, []) == pytest.approx(first, rel=1e-6)
    lower, higher = guess_probs(model, tok, 3, [8]), guess_probs(model, tok, 12, [8])  # "lower" / "higher"
    assert max(abs(lower[n] - higher[n]) for n in lower) > 1e-4
    assert guess_probs(model, tok, 5, [8]) == pytest.approx(lower, rel=1e-6)  # the same answer, the same context
    rows = last_guesses(shrunk)
    assert [r["secret"] for r in rows] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert rows[5]["before"] == [8, 12, 10] and 0 < rows[5]["p_correct"] < 1 and len(rows[5]["top"]) == 3
    # the build keeps the same reading of itself beside the model, and how many leaves greedy gets right
    kept = json.loads((shrunk / "warm_start.json").read_text())
    assert [r["secret"] for r in kept["last_guesses"]] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert [r["p_correct"] for r in kept["last_guesses"]] == pytest.approx([r["p_correct"] for r in rows], rel=1e-4)
    assert kept["leaves_right"] == sum(r["top"][0][0] == r["secret"] for r in rows)


def _context(secret: int, guesses: list[int]) -> tuple[str, ...]:
    """What the policy sees before a demonstration's last guess: the earlier guesses' answers."""
    from trainer_backend.demo.task import answer

    return tuple(f"{g}:{answer(secret, g)}" for g in guesses[:-1])


@pytest.mark.parametrize("turn", ["any", "found"])
def test_demonstrations_stay_on_the_bisection_tree_at_either_turn(turn: str) -> None:
    """Every demonstration is exact bisection up to its last guess, which is the midpoint or, as noise,
    a number still consistent with the answers; "found" ends each on the turn bisection finds its
    secret, so its context is the one tree node whose midpoint is that secret."""
    import random

    from trainer_backend.demo.task import HIGH, LOW, bisection_guesses, demo_decision

    rng = random.Random(0)
    for _ in range(600):
        secret = rng.randint(LOW, HIGH)
        clean = bisection_guesses(secret)
        g = demo_decision(secret, rng, 0.35, turn)
        assert g[:-1] == clean[:len(g) - 1]
        lo, hi = LOW, HIGH
        for x in g[:-1]:
            lo, hi = (x + 1, hi) if secret > x else (lo, x - 1)
        assert lo <= g[-1] <= hi
        if turn == "found":
            assert len(g) == len(clean)
    assert demo_decision(11, random.Random(1), 0.0, "found") == bisection_guesses(11) == [8, 12, 10, 11]


def test_found_turns_give_every_tree_context_the_same_share() -> None:
    """Over uniform secrets, "found" draws each of the tree's 15 contexts once per 15 secrets, where
    "any" draws the first guess's context in 36% of demonstrations and each last-guess context in 1.7%."""
    import random
    from collections import Counter

    from trainer_backend.demo.task import HIGH, LOW, demo_decision

    found = Counter(_context(s, demo_decision(s, random.Random(s), 0.0, "found")) for s in range(LOW, HIGH + 1))
    assert len(found) == 15 and set(found.values()) == {1}
    rng, draws = random.Random(2), 30_000
    anyturn: Counter[tuple[str, ...]] = Counter()
    for _ in range(draws):
        s = rng.randint(LOW, HIGH)
        anyturn[_context(s, demo_decision(s, rng, 0.0, "any"))] += 1
    assert set(anyturn) == set(found)
    assert anyturn[()] / draws == pytest.approx(16 / 45, abs=0.015)  # 1/15 + 2/30 + 4/45 + 8/60
    leaf = anyturn[("8:higher", "12:higher", "14:lower")] / draws
    assert leaf == pytest.approx(1 / 60, abs=0.004)


def test_the_demonstration_turn_is_keyed_and_checked_and_older_builds_keep_their_keys() -> None:
    """A "found" build never reuses an "any" one; the builds from before the field existed keep their
    keys (the folder names in every cache); an unknown turn fails in one line."""
    import random

    from trainer_backend.demo.task import demo_decision

    assert WarmStartConfig(precision="fp32", demo_turn="any", habit=0.0, max_rounds=1).key() == "18b9ee403f"
    assert WarmStartConfig(precision="fp32", demo_turn="found", habit=0.0, max_rounds=1).key() != "18b9ee403f"
    assert WarmStartConfig(precision="fp32").key() not in ("18b9ee403f", WarmStartConfig(demo_turn="any").key())
    with pytest.raises(ValueError, match="demo_turn must be one of any, found, not 'last'"):
        WarmStartConfig(demo_turn="last").resolved()
    with pytest.raises(ValueError, match="turn must be one of any, found, not 'last'"):
        demo_decision(3, random.Random(0), 0.35, "last")


def test_a_habit_makes_the_lowest_of_three_the_majority_and_nothing_else() -> None:
    """With habit h a 3-number range is demonstrated with its lowest in h + (1 - h) * eps / 3 of the
    draws, so at 0.5 the lowest outweighs the midpoint (what greedy decoding then keeps); wider and
    single-number ranges are untouched, and habit 0 draws exactly the demonstrations it drew before."""
    import random
    from collections import Counter

    from trainer_backend.demo.task import demo_decision

    rng, draws = random.Random(3), 20_000
    third: Counter[int] = Counter()  # secret 11's third guess, after 8 higher and 12 lower: the range 9..11
    first: Counter[int] = Counter()  # secret 11's first guess: the range 1..15
    for _ in range(draws):
        g = demo_decision(11, rng, 0.35, "any", 0.5)
        (third if len(g) == 3 else first if len(g) == 1 else Counter())[g[-1]] += 1
        assert len(g) != 4 or g[-1] == 11  # one number left: no habit, no noise
    n3, n1 = sum(third.values()), sum(first.values())
    assert third[9] / n3 == pytest.approx(0.5 + 0.5 * 0.35 / 3, abs=0.02)
    assert third[10] / n3 == pytest.approx(0.5 * (0.65 + 0.35 / 3), abs=0.02) and third[9] > third[10]
    assert first[8] / n1 == pytest.approx(0.65 + 0.35 / 15, abs=0.02)
    # the default warm start's 3,000 demonstrations, as its build draws them, hashed with the code before
    # `turn` and `habit` existed: its cached folder (the key, tested above) still holds what they give
    demo_rng, demos = random.Random("demos:0"), []
    for _ in range(3000):
        secret = demo_rng.randint(1, 15)
        demos.append(demo_decision(secret, demo_rng, 0.35, "any", 0.0))
    assert hashlib.sha1(repr(demos).encode()).hexdigest()[:12] == "8bc1feebefe9"
    assert WarmStartConfig(precision="fp32", habit=0.0).key() != WarmStartConfig(precision="fp32").key()
    with pytest.raises(ValueError, match=r"habit must be a probability in \[0, 1\], not 1.5"):
        WarmStartConfig(habit=1.5).resolved()


def test_the_demo_says_how_many_leaves_its_warm_start_gets_right(shrunk: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's first stage reads the build's own reading of itself (warm_start.json) into its results
    and its output, so a warm start that never learned the later answers is visible before any RL."""
    from trainer_backend.demo.run import DemoConfig, DemoRun

    run = DemoRun(DemoConfig(out_dir=str(tmp_path / "out"), model_dir=str(shrunk), warm_start_precision="fp32"))
    run.warm_start()
    right = run.results["warm_start"]["leaves_right"]
    assert 0 <= right <= 8 and right == json.loads((shrunk / "warm_start.json").read_text())["leaves_right"]
    assert f"greedy last guess right at {right} of 8 leaves of the bisection tree" in capsys.readouterr().out


def test_a_build_that_reads_too_few_leaves_runs_its_schedule_again(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """With max_rounds, a build whose greedy last guess is wrong at a leaf runs the whole schedule again
    (warm-up included) from the weights it ended on, and stops at the bound or once every leaf is read;
    warm_start.json keeps each round's reading and every step's lr."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from trainer_backend.demo.run import DemoConfig, DemoRun
    from trainer_backend.demo.warm_start import warm_start
    from trainer_backend.engines.torch_config import schedule_factor

    cfg = replace(SHRUNK, max_rounds=2)
    built = warm_start(tmp_path / "ws", cfg, progress=False, threads=1)
    kept = json.loads((built / "warm_start.json").read_text())
    by_round = kept["leaves_right_by_round"]
    assert by_round[0] < 8  # eight steps on 64 demonstrations read no tree: the case this exists for
    rounds = by_round.index(8) + 1 if 8 in by_round else 2
    assert len(by_round) == rounds >= 2 and kept["leaves_right"] == by_round[-1]
    assert kept["max_rounds"] == 2 and len(kept["curve"]["loss"]) == 8 * rounds
    one = [cfg.lr * schedule_factor(k, "linear", 2, 8, 0.1) for k in range(8)]
    assert kept["curve"]["lr"] == pytest.approx(one * rounds)  # each round from its warm-up
    assert len(kept["last_guesses"]) == 8 and sum(
        row["top"][0][0] == row["secret"] for row in kept["last_guesses"]) == by_round[-1]
    DemoRun(DemoConfig(out_dir=str(tmp_path / "out"), model_dir=str(built), warm_start_precision="fp32")).warm_start()
    assert f"right at {by_round[-1]} of 8 leaves of the bisection tree after {rounds} runs of the SFT schedule" \
        in capsys.readouterr().out


def test_rounds_are_keyed_and_checked() -> None:
    pytest.importorskip("torch")
    assert WarmStartConfig.max_rounds == 4  # the default: rounds until every leaf is read, at most four
    assert WarmStartConfig(max_rounds=2).key() != WarmStartConfig(max_rounds=1).key()
    with pytest.raises(ValueError, match="max_rounds and sft_steps must be at least 1, not 0 and 250"):
        WarmStartConfig(max_rounds=0).resolved()
    with pytest.raises(ValueError, match="max_rounds and sft_steps must be at least 1, not 4 and 0"):
        WarmStartConfig(sft_steps=0).resolved()
