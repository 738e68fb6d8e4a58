"""Graceful preemption: SIGTERM / SIGUSR1 finish the current step, save, and exit 0.

Schedulers signal every rank, but not at the same instant, so ranks agree on stopping through a
MAX all-reduce of their flags once per step: no rank leaves a collective the others still wait in.
"""
from __future__ import annotations

import logging
import signal
from types import FrameType

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, device: torch.device) -> None:
        self._requested = False
        self._device = device
        self._previous = {}
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.warning("received %s: finishing the current step, then saving and exiting",
                       signal.Signals(signum).name)
        self._requested = True

    def should_stop(self) -> bool:
        """Collective when a process group exists: every rank must call it at the same step."""
        if not dist.is_initialized():
            return self._requested
        flag = torch.tensor([1 if self._requested else 0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
