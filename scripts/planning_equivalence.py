"""Compare the --estimate-memory and --dry-run text of a baseline revision and the checkout, for the documented
planning commands and every registered config; the logic is in torchtitan_lite.tools.planning_equivalence."""
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
from torchtitan_lite.tools.planning_equivalence import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
