"""The TensorBoard event writer of a run: opened at its first scalar, and reopened after a disk error, so a full
disk costs the values of the steps it was full and no more."""
from __future__ import annotations

import contextlib
from typing import Any


class FirstWriteSummaryWriter:
    """A ``SummaryWriter`` created at the first scalar: a run refused before it trained (a resume that
    does not fit, a full disk) leaves no event file in the dump folder. Errors (OSError) surface from
    ``add_scalar`` and ``flush``; the failed ``SummaryWriter`` (whose writer thread keeps raising its
    error once it had one) is dropped, and the next scalar opens a new event file."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.writer: Any = None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=self.folder)
        try:
            self.writer.add_scalar(tag, value, step)
        except OSError:
            self._drop()
            raise

    def flush(self) -> None:
        if self.writer is not None:
            try:
                self.writer.flush()
            except OSError:
                self._drop()
                raise

    def _drop(self) -> None:
        writer, self.writer = self.writer, None
        with contextlib.suppress(Exception):
            writer.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
