#!/usr/bin/env bash
# Runs the linter, the type checker and the whole test suite (unit, multi-process gloo, end-to-end) with the project's environment.
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -m "not slow" -k config
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$root/scripts/setup_env.sh")"
cd "$root"
# Lint, import order and types first: a failure here costs seconds, not a test run.
"$py" -m ruff check --quiet .
"$py" -m mypy --no-error-summary
exec "$py" -m pytest -q -p no:cacheprovider --durations=15 "$@"
