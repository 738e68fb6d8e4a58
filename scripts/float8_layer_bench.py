"""Forward + backward time of one Linear in high precision vs each FP8 recipe; the logic is in
torchtitan_lite.tools.float8_layer_bench."""
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
import torchtitan_lite.tools.script_start  # noqa: E402, F401  (before torchao prints its notices)

# isort: split
import models  # noqa: E402, F401  (registers the model families: --shapes llama3_<flavor>)
from torchtitan_lite.tools.float8_layer_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
