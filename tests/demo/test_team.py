"""`lightning-mw demo --task team`: the roles' rewards and the CLI (the slow run: test_team_demo.py)."""

from __future__ import annotations

import pytest

from trainer_backend.demo.task import HIGH, LOW, bisection_guesses
from trainer_backend.demo.team import GOOD_RANGE, SCOUT_GUESSES, consistent_range, policies_of, role_rewards


def test_consistent_range_follows_the_answers() -> None:
    assert consistent_range(5, []) == HIGH - LOW + 1
    assert consistent_range(5, [8]) == 7  # 1..7
    assert consistent_range(5, [8, 4]) == 3  # 5..7
    assert consistent_range(5, [8, 4, 5]) == 0  # found
    assert consistent_range(5, [8, 12]) == 7  # a guess the answers had ruled out narrows nothing
    assert consistent_range(5, [-1, 99]) == HIGH - LOW + 1  # invalid guesses narrow nothing


@pytest.mark.parametrize("secret", range(LOW, HIGH + 1))
def test_bisection_earns_both_roles_their_reward(secret: int) -> None:
    guesses = bisection_guesses(secret)
    assert role_rewards(secret, guesses, min(SCOUT_GUESSES, len(guesses))) == {"scout": 1.0, "closer": 1.0}


def test_each_role_is_judged_on_its_own_part() -> None:
    # a poor scout (1, 2 leave 13 numbers) and a lucky closer: the closer is rewarded, the scout not
    assert role_rewards(9, [1, 2, 9], 2) == {"scout": 0.0, "closer": 1.0}
    # a good scout (8, 12 leave 13..15) and a closer that misses twice
    assert role_rewards(14, [8, 12, 13, 15], 2) == {"scout": 1.0, "closer": 0.0}
    assert consistent_range(14, [8, 12]) <= GOOD_RANGE
    # the scout finding the number itself: both rewarded
    assert role_rewards(8, [8], 1) == {"scout": 1.0, "closer": 1.0}


def test_separate_or_shared_policies() -> None:
    assert policies_of(False) == {"scout": "scout", "closer": "closer"}
    assert set(policies_of(True).values()) == {"team"}


def test_cli_takes_the_team_task() -> None:
    from lightning_middleware.cli import build_parser, main

    args = build_parser().parse_args(["demo", "--task", "team", "--shared-policy"])
    assert args.task == "team" and args.shared_policy
    assert main(["demo", "--shared-policy"]) == 2  # --shared-policy without the team task
