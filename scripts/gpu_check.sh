#!/usr/bin/env bash
# GPU acceptance run (torchtitan_lite/tools/gpu_check.py): stages by priority within --budget seconds (FP8 layer
# bench at 8B shapes, a representative 8B-width proxy with expected-vs-measured speedups, compiled MoE at 1,024
# tokens per expert, CUDA tests, ...), each stage's figure written as it ends. Runs with the interpreter in
# TTL_PYTHON (default: python3 on PATH, or the project's .venv that README command 1 made when that python3 has no
# torch, as on a CPU machine planning a run); it creates no environment and needs no network.
#   scripts/gpu_check.sh --plan                 # expected time per stage and what the budget fits; no GPU needed
#   TTL_PYTHON=/usr/bin/python3 scripts/gpu_check.sh --budget 540 --wheels gpu_wheels
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${TTL_PYTHON:-}" ]; then
  TTL_PYTHON="$(command -v python3)"
  if ! "$TTL_PYTHON" -c 'import torch' >/dev/null 2>&1 && [ -x "$root/.venv/bin/python" ]; then
    TTL_PYTHON="$root/.venv/bin/python"
  fi
fi
export TTL_PYTHON
cd "$root"
exec "$TTL_PYTHON" -m torchtitan_lite.tools.gpu_check "$@"
