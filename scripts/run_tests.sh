#!/usr/bin/env bash
# Runs the linter, the type checker and the default test suite (unit, multi-process gloo, end-to-end: every feature at
# least once) with the project's environment. Extra arguments go to pytest, e.g. scripts/run_tests.sh -k config.
# Cases marked `slow` (longer variants of what the default suite covers) run with -m slow, everything with -m "".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$root/scripts/setup_env.sh")"
cd "$root"
# Lint, import order and types first: a failure here costs seconds, not a test run.
"$py" -m ruff check --quiet .
"$py" -m mypy --no-error-summary
# The default selection leaves out the `slow` cases; any -m of the caller replaces it.
select=(-m "not slow")
for a in "$@"; do
  case "$a" in -m*|--markexpr*) select=();; esac
done
exec "$py" -m pytest -q -p no:cacheprovider --durations=15 ${select[@]+"${select[@]}"} "$@"
