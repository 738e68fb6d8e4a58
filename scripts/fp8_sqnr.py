"""Per-Linear FP8 numerics: SQNR of the FP8 forward output and gradients; the logic is in torchtitan_lite.tools.fp8_sqnr."""
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
import torchtitan_lite.tools.script_start  # noqa: E402, F401  (before torchao prints its notices)

# isort: split
import models  # noqa: E402, F401  (registers the model families)
from config_registry import DEFAULT_REGISTRY  # noqa: E402
from torchtitan_lite.tools.fp8_sqnr_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], registry=DEFAULT_REGISTRY))
