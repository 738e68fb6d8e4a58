#!/usr/bin/env bash
# Prints the path of a Python interpreter that has torchtitan_lite's dependencies, creating
# ./.venv on first use. Used by run_train.sh and scripts/run_tests.sh so that both work on a
# fresh machine. Set TTL_PYTHON to force an interpreter.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Finds every package without importing it: importing them all cost ~5 s of CPU before every command,
# --help included. The stamp below notices changed dependency lists.
probe='import importlib.util, sys
names = "torch torchao datasets sentencepiece tokenizers huggingface_hub tensorboard safetensors pytest ruff mypy transformers wandb torchtitan_lite config_registry"
sys.exit(any(importlib.util.find_spec(name) is None for name in names.split()))'
# Only the dependency lists decide whether the environment must be refreshed.
stamp_of() { sed -n '/^dependencies/,/^\[tool.setuptools/p' "$root/pyproject.toml" | sha256sum | cut -c1-16; }

if [ -n "${TTL_PYTHON:-}" ]; then echo "$TTL_PYTHON"; exit 0; fi
venv="$root/.venv"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.ttl_stamp" 2>/dev/null)" = "$(stamp_of)" ] \
   && (cd / && "$venv/bin/python" -c "$probe") >/dev/null 2>&1; then
  echo "$venv/bin/python"; exit 0
fi

echo "[setup] preparing $venv (first use, or its dependencies changed; about a minute)" >&2
python3 -m venv "$venv" >&2
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  # Without a GPU take the CPU wheel explicitly: an unpinned torch resolves to a multi-GB CUDA build.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" "torch>=2.11,<2.15" >&2
  else
    "${pip[@]}" "torch==2.13.0" >&2
  fi
fi
# compat mode puts the repository root on sys.path (a .pth entry) instead of a finder that
# snapshots the package layout at install time and misses packages added later.
"${pip[@]}" -e "$root[test]" --config-settings editable_mode=compat >&2
stamp_of > "$venv/.ttl_stamp"
echo "$venv/bin/python"
