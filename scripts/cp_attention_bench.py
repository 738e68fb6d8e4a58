"""One attention layer with its context-parallel K/V gather on 1, 2 and 4 gloo CPU ranks: time, saved bytes,
mask bytes, communication bytes against the formula; logic in torchtitan_lite.tools.cp_attention_bench."""
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
import torchtitan_lite.tools.script_start  # noqa: E402, F401  (before torchao prints its notices)

# isort: split
from models.common.attention.mask import build_mask  # noqa: E402  (registers the families; the model's mask)
from torchtitan_lite.tools.cp_attention_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], build_mask=build_mask))
