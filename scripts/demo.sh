#!/usr/bin/env bash
# Set up (idempotent) and run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if .venv/bin/lightning-mw demo --help >/dev/null 2>&1; then
  exec .venv/bin/lightning-mw demo "$@"
fi
exec .venv/bin/lightning-mw example "$@"
