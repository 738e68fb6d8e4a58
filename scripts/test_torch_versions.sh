#!/usr/bin/env bash
# Runs the test suite against other torch releases, each in its own virtual environment under
# ${TTL_VERSIONS_DIR:-/tmp/ttl_torch_versions}/torch-VERSION (never inside the repository), with the
# registry's default torch wheel for that version (a CUDA build on Linux, which also runs on CPU).
#   scripts/test_torch_versions.sh 2.11.0 2.14.1                           # the whole suite on each
#   scripts/test_torch_versions.sh 2.11.0 -- tests/unit/test_compat.py -k fsdp  # pytest arguments after --
# TORCHAO (default: the version pyproject.toml allows) is installed beside each torch. The last lines
# print one summary per torch version; the exit status is non-zero if any version failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${TTL_VERSIONS_DIR:-/tmp/ttl_torch_versions}"
torchao="${TORCHAO:-$(sed -n 's/^ *"torchao\([^"]*\)",$/torchao\1/p' "$root/pyproject.toml")}"
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#versions[@]} -eq 0 ]; then
  echo "usage: $0 TORCH_VERSION... [-- PYTEST_ARGS...]   e.g. $0 2.11.0 2.14.1" >&2; exit 2
fi
case "$base" in "$root"|"$root"/*) echo "error: TTL_VERSIONS_DIR must be outside the repository" >&2; exit 2;; esac

summaries=()
status=0
for v in "${versions[@]}"; do
  venv="$base/torch-$v"
  log="$base/torch-$v.log"
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$v')" >/dev/null 2>&1; then
    echo "[torch $v] creating $venv (downloads torch $v and its dependencies once)"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$v"
  fi
  # The project's other dependencies; the pinned torch is kept (a constraint, so pip cannot swap it).
  echo "torch==$v" > "$venv/constraints.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$venv/constraints.txt" "$torchao" \
    -e "$root[test]" --config-settings editable_mode=compat
  echo "[torch $v] $("$venv/bin/python" -c 'import torch, torchao; print("torch", torch.__version__, "torchao", torchao.__version__)')"
  set +e
  (cd "$root" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@") 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  summaries+=("torch $v: $(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$log" | tail -1) (exit $rc; log $log)")
  [ "$rc" -eq 0 ] || status=1
done
printf '%s\n' "${summaries[@]}"
exit $status
