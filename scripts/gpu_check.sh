#!/usr/bin/env bash
# GPU acceptance run (torchtitan_lite/tools/gpu_check.py): stages by priority within --budget seconds (FP8 layer
# bench at 8B shapes, a representative 8B-width proxy with expected-vs-measured speedups, compiled MoE at 1,024
# tokens per expert, CUDA tests, ...), each stage's figure written as it ends. Runs with the interpreter in
# TTL_PYTHON (default: python3 on PATH); it creates no environment and needs no network.
#   scripts/gpu_check.sh --plan                 # expected time per stage and what the budget fits; no GPU needed
#   TTL_PYTHON=/usr/bin/python3 scripts/gpu_check.sh --budget 540 --wheels gpu_wheels
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TTL_PYTHON="${TTL_PYTHON:-$(command -v python3)}"
cd "$root"
exec "$TTL_PYTHON" -m torchtitan_lite.tools.gpu_check "$@"
