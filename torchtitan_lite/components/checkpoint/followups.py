"""What followed each checkpoint: whether a normal loss ever trained from its state.

That is learned only after the checkpoint is saved, often by a later process, so it is kept in the
checkpoint's marker (``Marker.followed_by``): NOTHING_YET when written, NORMAL once a step trained from it to
a normal loss, ABNORMAL while only non-finite or spiking losses did. Rank 0 rewrites the marker in place as
it learns; a background save takes what was learned while it was writing.
"""
from __future__ import annotations

import logging
import os
import threading

import torch.distributed as dist

from torchtitan_lite.components.checkpoint.layout import ABNORMAL, MARKER_NAME, NORMAL, NOTHING_YET, Marker, step_dir

logger = logging.getLogger(__name__)


class Followups:
    """The followed-by facts of the checkpoints in ``folder`` that this process saved or loaded."""

    def __init__(self, folder: str, *, rank: int, world_size: int) -> None:
        self.folder, self.rank, self.world_size = folder, rank, world_size
        self._saved_at: dict[int, float] = {}
        """Step -> marker time of the checkpoints this process saved or loaded: what it may record facts in."""
        self._followed_by: dict[int, str] = {}
        """Step -> what this process saw follow that checkpoint (NORMAL / ABNORMAL)."""
        self._lock = threading.Lock()
        """Markers are written by the background save thread and rewritten by the training loop."""

    def saving(self, marker: Marker) -> None:
        """``marker``'s checkpoint is being written now: nothing has followed it yet."""
        self._saved_at[marker.step] = marker.time
        self._followed_by.pop(marker.step, None)

    def adopt(self, marker: Marker) -> None:
        """Training goes on from ``marker``'s checkpoint: what follows it is recorded there, on top of what
        earlier runs recorded."""
        self._saved_at[marker.step] = marker.time
        if marker.followed_by in (NORMAL, ABNORMAL):
            self._followed_by[marker.step] = marker.followed_by

    def write_marker(self, path: str, marker: Marker) -> None:
        """Write a new checkpoint's marker with what followed its state while it was being written."""
        with self._lock:
            marker.followed_by = self._followed_by.get(marker.step, NOTHING_YET)
            marker.write(path)

    def record(self, step: int, followed_by: str) -> None:
        """Rank 0 stores ``followed_by`` in the marker of checkpoint ``step`` if this process saved or loaded
        it (a background save gets it when its marker is written); NORMAL is never downgraded."""
        if self.rank != 0 or step not in self._saved_at or self._followed_by.get(step) in (NORMAL, followed_by):
            return
        with self._lock:
            self._followed_by[step] = followed_by
            path = step_dir(self.folder, step)
            try:
                marker = Marker.read(path)
                if marker is not None and marker.time == self._saved_at[step]:
                    marker.followed_by = followed_by
                    marker.write(path)
            except (OSError, ValueError) as e:
                logger.warning("could not record in %s that a%s loss followed it: %s", os.path.join(path, MARKER_NAME),
                               "n abnormal" if followed_by == ABNORMAL else " normal", e)

    def normal(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` whose checkpoint a normal loss followed, as recorded in their markers (by this
        run or an earlier one); rank 0 reads them, every rank gets the answer."""
        found: list[list[int] | None] = [None]
        if self.rank == 0:
            found = [[s for s in steps if _followed_by(step_dir(self.folder, s)) == NORMAL]]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return found[0] or []

    def warn_on_resume(self, path: str, marker: Marker, complete: list[int]) -> None:
        """Say so when training resumes from a state no normal loss followed."""
        if marker.followed_by == ABNORMAL:
            good = self.normal(complete)
            logger.warning(
                "resuming from %s, which no normal loss ever followed: the step trained from it went non-finite or "
                "spiked before (recorded in its %s marker), so its weights may be damaged. %s", path, MARKER_NAME,
                f"Step {good[-1]} is the newest checkpoint a normal loss followed (--checkpoint.load_step "
                f"{good[-1]})" if good else "No checkpoint in this folder was followed by a normal loss")
        elif marker.followed_by == NOTHING_YET:
            logger.info("resuming from %s: no step has trained from it yet, so no normal loss has vouched for it", path)


def _followed_by(path: str) -> str | None:
    try:
        marker = Marker.read(path)
    except ValueError:
        return None
    return None if marker is None else marker.followed_by
