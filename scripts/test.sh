#!/usr/bin/env bash
# Set up (idempotent), lint and type-check, then run the whole test suite: store tests start
# their own PostgreSQL, serving tests start one shared vLLM CPU server. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
echo "[test] ruff (lint + import order)"
.venv/bin/ruff check .
echo "[test] mypy (lightning_middleware, adapters, trainer_backend)"
.venv/bin/mypy
# The serving tests need the vLLM environment: create it rather than skip them.
export LIGHTNING_TEST_INSTALL_VLLM=1
exec .venv/bin/python -m pytest -q -ra --timeout=900 "$@"
