"""Runs inside torchtitan's own virtual environment (scripts/torchtitan_side_by_side.py makes it); the
logic is in torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_cpu."""
import sys
from pathlib import Path

# The repository root last: this runs in torchtitan's environment, where nothing of ours may shadow
# its modules; the module imported here needs only the standard library and torch.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_cpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
