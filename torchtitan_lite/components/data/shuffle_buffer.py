"""A bounded shuffle buffer of windows, for streams (``data.shuffle_buffer``).

A stream cannot be permuted globally: its windows arrive in shard order. The buffer holds ``size`` windows;
once full, each arriving window takes the place of one drawn at random, which is handed out. Every window is
handed out once (the ones still held when training stops are simply not read yet), and a window moves at most
``size`` places forward on average, so the buffer mixes documents over a span of ``size`` windows of the
stream. The draws come from a PCG64 generator seeded by ``(seed, data-parallel rank)``; its state and the
held windows are the buffer's state, so a run resumes from a checkpoint exactly as if it had not stopped.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch


class ShuffleBuffer:
    def __init__(self, size: int, seed: int, dp_rank: int, window: int) -> None:
        if size < 1:
            raise ValueError(f"a shuffle buffer holds at least one window, got size={size}")
        self.size, self.window = size, window
        self._rng = np.random.Generator(np.random.PCG64([seed, dp_rank]))
        self._held: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._held)

    def push(self, window: np.ndarray) -> np.ndarray | None:
        """Take ``window``; hand out one window drawn from the buffer, or None while it is still filling."""
        if len(self._held) < self.size:
            self._held.append(window)
            return None
        j = int(self._rng.integers(self.size))
        out, self._held[j] = self._held[j], window
        return out

    def state_dict(self) -> dict[str, Any]:
        held = np.stack(self._held) if self._held else np.empty((0, self.window), dtype=np.int32)
        # The generator's state holds 128-bit integers: JSON keeps them exact and loads with weights_only.
        return {"size": self.size, "rng": json.dumps(self._rng.bit_generator.state),
                "held": torch.from_numpy(held.astype(np.int32, copy=True))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["size"]) != self.size:
            raise ValueError(f"data loader state was saved with data.shuffle_buffer={state['size']}, this run has "
                             f"{self.size}: the held windows and the draws would differ. Restore that setting, or "
                             f"start the data from the beginning by excluding 'dataloader' from checkpoint loading")
        self._rng.bit_generator.state = json.loads(state["rng"])
        self._held = [row for row in state["held"].numpy().astype(np.int32, copy=True)]
