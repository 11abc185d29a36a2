#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: store tests start their own PostgreSQL,
# serving tests start one shared vLLM CPU server. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
# The serving tests need the vLLM environment: create it rather than skip them.
export LIGHTNING_TEST_INSTALL_VLLM=1
exec .venv/bin/python -m pytest -q -ra --timeout=900 "$@"
