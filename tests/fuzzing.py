"""What the property-based (hypothesis) tests share: how many examples each runs, and a count of
the cases they tried, which the test run reports at its end (tests/conftest.py).

The default suite runs each fuzz test briefly (seconds). `LIGHTNING_FUZZ_SCALE=N` multiplies
every test's examples by N, for a long run (docs/reliability.md, "Bad input"):

    LIGHTNING_FUZZ_SCALE=20 python -m pytest -q tests/gateway/test_bad_input.py ...
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("LIGHTNING_FUZZ_SCALE", "1")))
CASES: Counter[str] = Counter()  # cases tried, by what was fuzzed


# The default run (the suite, CI) draws the same cases every time, so a change is never failed by
# a case it did not cause; a long run (LIGHTNING_FUZZ_SCALE > 1) or LIGHTNING_FUZZ_RANDOM=1 draws
# new ones, which is where new failures are found (then pinned with @example).
DERANDOMIZE = SCALE == 1 and os.environ.get("LIGHTNING_FUZZ_RANDOM") != "1"


def fuzz(examples: int) -> settings:
    """Settings for one fuzz test: `examples` (times the scale), no per-example deadline (a shared
    2-core machine makes timings noisy), and no example database written into the work tree."""
    return settings(max_examples=examples * SCALE, deadline=None, database=None, derandomize=DERANDOMIZE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


def tried(what: str) -> None:
    """Count one case of `what`."""
    CASES[what] += 1
