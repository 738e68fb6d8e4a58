#!/usr/bin/env bash
# GPU acceptance run (torchtitan_lite/tools/gpu_check.py): CUDA tests, FP8 layer bench, 8B-width throughput,
# FP8 loss check, all under one output folder. Runs with the interpreter in TTL_PYTHON (default: python3
# on PATH); it creates no environment and needs no network. --wheels DIR installs carried wheels first.
#   scripts/gpu_check.sh --plan          # what it would run; works without a GPU
#   TTL_PYTHON=/usr/bin/python3 scripts/gpu_check.sh --wheels gpu_wheels
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TTL_PYTHON="${TTL_PYTHON:-$(command -v python3)}"
cd "$root"
exec "$TTL_PYTHON" -m torchtitan_lite.tools.gpu_check "$@"
