"""Check checkpoints offline: markers, .metadata, shard lengths and content checksums.

    python scripts/verify_checkpoint.py outputs/llama3_debug/checkpoint            every step-<N> in the folder
    python scripts/verify_checkpoint.py outputs/llama3_debug/checkpoint/step-200   one checkpoint

Prints one line per checkpoint (OK, or what is wrong: file and tensor byte range); exits 1 when any
checkpoint fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a checkpoint folder (step-<N>) or the folder holding them")
    args = parser.parse_args(argv)
    from torchtitan_lite.components.checkpoint.verify import CheckpointError, verify_folder

    try:
        results = verify_folder(args.path)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, problems in results.items():
        print(f"{path}: {'OK' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"  {problem}")
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
