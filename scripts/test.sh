#!/usr/bin/env bash
# Set up (idempotent), lint and type-check, then run the whole test suite: store tests start
# their own PostgreSQL, serving tests start one shared vLLM CPU server. Extra arguments go to pytest.
#   --quick                   the quick tier, to run while working: every test that needs no vLLM
#                             server, no demo and no browser (tests/workers.py); not a replacement for CI
#   LIGHTNING_TEST_STRESS=N   keep N cores busy (Debian's stress-ng, installed for that run) while
#                             the suite runs: the check that no test's deadline depends on a quiet machine
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
if [ "$quick" = 1 ]; then LIGHTNING_SKIP_VLLM=1 bash scripts/setup.sh; else bash scripts/setup.sh; fi
export PYTHONUNBUFFERED=1
# Some machine images set PYTHONDONTWRITEBYTECODE: then every pytest worker and every Python process
# a test starts compiles our modules again, and pytest rewrites each test module's asserts again.
unset PYTHONDONTWRITEBYTECODE
echo "[test] ruff (lint + import order)"
.venv/bin/ruff check .
# mypy needs one core for ~2.5 min on a cold cache; the suite's first minutes leave the other idle,
# so it runs beside them and its verdict is read at the end.
echo "[test] mypy (lightning_middleware, adapters, trainer_backend), beside the tests"
mypy_log=$(mktemp)
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
stress_pid=""
cleanup() { [ -n "$stress_pid" ] && kill "$stress_pid" 2>/dev/null; rm -f "$mypy_log"; }
trap cleanup EXIT
if [ "${LIGHTNING_TEST_STRESS:-0}" != "0" ]; then
  if ! command -v stress-ng >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq stress-ng >/dev/null
  fi
  echo "[test] keeping ${LIGHTNING_TEST_STRESS} core(s) busy: stress-ng --cpu ${LIGHTNING_TEST_STRESS}"
  stress-ng --cpu "$LIGHTNING_TEST_STRESS" --timeout 3h --quiet &
  stress_pid=$!
fi
# The serving tests need the vLLM environment: create it rather than skip them; and a test skipped
# for a missing module fails (tests/strict.py): the set-up above installed every extra.
export LIGHTNING_TEST_INSTALL_VLLM=1 LIGHTNING_TEST_REQUIRE_ALL=1
status=0
# Two pytest-xdist workers. `--dist loadgroup` keeps the tests that share a session server on one
# worker, and the demos two by two one after another; without xdist's reordering of groups by size
# the SmolLM2 demos' group, first in the collection, starts at once, and the tiny model's, last,
# goes to the worker that runs out of other work first (tests/workers.py).
# The quick tier takes three: its tests mostly wait on servers and subprocesses, so a third worker
# fills the cores' idle time (docs/benchmarks.md, "The quick tier"). LIGHTNING_TEST_WORKERS=0 runs serially.
default_workers=2
[ "$quick" = 1 ] && default_workers=3
workers=${LIGHTNING_TEST_WORKERS:-$default_workers}
xdist=()
[ "$workers" != "0" ] && xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
tier=()
[ "$quick" = 1 ] && tier=(-m "$(.venv/bin/python -c 'from tests.workers import QUICK; print(QUICK)')")
.venv/bin/python -m pytest -q -ra --timeout=900 "${xdist[@]}" "${tier[@]}" "$@" || status=$?
if ! wait "$mypy_pid"; then
  echo "[test] mypy failed:"; cat "$mypy_log"; exit 1
fi
exit "$status"  # mypy passed: pytest's summary stays the last line
