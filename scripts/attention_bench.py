"""Causal attention forward + backward per kernel choice at given shapes; logic in torchtitan_lite.tools.attention_bench."""
import sys
from functools import partial
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
from models.common.attention.grouped_query import causal_attention  # noqa: E402
from torchtitan_lite.tools.attention_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], model_attention=partial(causal_attention, enable_gqa=True)))
