"""Train with a planted FP8 fault (fp8_faults.py) installed for the whole run: the fault arm of
scripts/loss_compare.py's FP8 verdict, which must read FAIL for the verdict to count.

    python -m torchtitan_lite.tools.fault_train --fault round_toward_zero --config llama3_debug_fp8 --training.steps 100

The fault is named on this command line only; no training config can reach it. One process (the faults patch
the process they run in).
"""
from __future__ import annotations

import sys

from torchtitan_lite.tools.repo import REPO_ROOT


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--fault":
        print("usage: python -m torchtitan_lite.tools.fault_train --fault NAME <train.py arguments>", file=sys.stderr)
        return 2
    name, train_argv = argv[1], argv[2:]
    from torchtitan_lite.library_notices import silence_known_library_notices

    silence_known_library_notices()  # train.main would, but the faults import torchao first
    from torchtitan_lite.tools.fp8_faults import FAULTS, plant

    if name not in FAULTS:
        print(f"error: unknown planted fault {name!r}; choose one of: {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO_ROOT))
    import train

    with plant(name):
        print(f"planted fault {name}: {FAULTS[name].bug}", flush=True)
        return train.main(train_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
