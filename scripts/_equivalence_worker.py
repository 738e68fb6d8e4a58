"""One run of scripts/layout_equivalence.py: build the trainer from the command line, write the model's initial
state (a DCP checkpoint of every rank's shards, before any step), then train.

Unlike the other scripts it holds its logic and leaves sys.path alone: it must run the project found first on
PYTHONPATH (a baseline revision's source, or the checkout's), so it uses only what every revision exposes (the
parsed config's ``build()``, the checkpointer's model state).
"""
import sys

import torchtitan_lite.tools.project_python  # noqa: F401  (no torch in this Python: re-runs with the project's)
import torchtitan_lite.tools.script_start  # noqa: F401  (before torchao prints its notices)

# isort: split
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import models  # noqa: F401  (registers the model families)
from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.config import parse_cli


def main(argv: list[str]) -> int:
    initial_dir, args = argv[0], argv[1:]
    trainer = parse_cli(args, registry=DEFAULT_REGISTRY).config.build()
    dcp.save({"model": trainer.checkpointer.states["model"].state_dict()}, checkpoint_id=initial_dir)
    trainer.train()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
