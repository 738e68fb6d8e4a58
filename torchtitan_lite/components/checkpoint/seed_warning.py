"""The warning for a seed checkpoint written over a later run: the check before launch and the trainer both give
it, so it lives beside the checkpoint layout rather than in either of them."""
from __future__ import annotations

import os

from torchtitan_lite.components.checkpoint.layout import scan_steps


def seed_over_later_run(dump_folder: str, checkpoint_folder: str) -> str | None:
    """The warning for a seed checkpoint written into a folder that holds a later run's checkpoints: a run
    there resumes from the newest of them, never from the seed. None when the folder holds no later step."""
    folder = os.path.join(dump_folder, checkpoint_folder)
    later = [s for s in scan_steps(folder)[0] if s > 0]
    if not later:
        return None
    return (f"checkpoint.create_seed_checkpoint writes step 0 into {folder}, which holds the checkpoints of steps "
            f"{later} of a later run: a run in this folder resumes from step {later[-1]}, not from the seed. Write the "
            f"seed to a folder of its own (--job.dump_folder DIR) and start from it with "
            f"--checkpoint.initial_load_path DIR/{checkpoint_folder}/step-0")
