"""Pipeline bubble of each schedule on 2 and 4 gloo CPU ranks (or GPUs) against the theory; logic in
torchtitan_lite.tools.pipeline_bubble."""
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
import torchtitan_lite.tools.script_start  # noqa: E402, F401  (before torchao prints its notices)

# isort: split
import models  # noqa: E402, F401  (registers the model families the ranks build)
from torchtitan_lite.tools.pipeline_bubble import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
