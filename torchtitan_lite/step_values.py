"""Each step's loss and gradient norm stay on the device until the loop needs them on the host.

Reading a device value (``float(t)``, ``.item()``, ``.tolist()``, ``if t:``) waits for every kernel queued
before it: on a GPU the CPU then cannot queue the next step while this one runs. So a step only queues
its loss and norm here, and the loop reads them when something must act on them: a log step, a
checkpoint save, a validation, a rollback. One read then brings every step queued since the previous
read, and what those steps feed (the non-finite stop, ``LossHealth``) is applied to them in step order,
as it would have been had each step been read the moment it ended.

With the spike policy on, each step's numbers are read as it ends (the policy decides whether the update
is applied); they are queued here already on the host, so a log step reads nothing more.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepValues:
    step: int
    loss: float
    grad_norm: float
    applied: bool
    """Whether the step's update was applied (False when the spike policy skipped or rolled it back)."""


class PendingSteps:
    """Steps whose loss and norm the host has not acted on yet, oldest first."""

    def __init__(self) -> None:
        self._steps: list[tuple[int, torch.Tensor | tuple[float, float], bool]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, *, applied: bool) -> None:
        """Queue a step's (scalar, on-device) loss and norm without reading them."""
        values = torch.stack([loss.detach().float(), grad_norm.detach().to(loss.device).float()])
        self._steps.append((step, values, applied))

    def add_read(self, step: int, loss: float, grad_norm: float, *, applied: bool) -> None:
        """Queue a step whose loss and norm were already read to the host."""
        self._steps.append((step, (loss, grad_norm), applied))

    def read(self) -> list[StepValues]:
        """Every queued step's values, oldest first, with at most one device read for all of them; empties
        the queue."""
        steps, self._steps = self._steps, []
        on_device = [values for _, values, _ in steps if isinstance(values, torch.Tensor)]
        # The one host-device synchronisation: float32 values come back exactly, as float() would read them.
        read = iter(torch.stack(on_device).tolist()) if on_device else iter(())
        result = []
        for step, values, applied in steps:
            loss, grad_norm = next(read) if isinstance(values, torch.Tensor) else values
            result.append(StepValues(step, loss, grad_norm, applied))
        return result
