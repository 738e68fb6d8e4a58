"""The loop's own resumable state: step, tokens seen and this rank's random number generators."""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from typing import Any

import torch


def check_steps_ahead(step: int, steps: int, folder: str) -> None:
    """A run resumed from ``step`` must have steps left to train: one past training.steps would exit at once,
    having trained nothing, and rewrite the folder's config.toml with a length the checkpoints never had."""
    if step > steps:
        raise ValueError(
            f"the checkpoint in {folder} is at step {step}, beyond training.steps={steps}: resuming it would train "
            f"nothing. Set --training.steps above {step} to train on, --checkpoint.load_step to an earlier step, "
            f"or give a new run its own --job.dump_folder")


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    loss_sum: float = 0.0
    """Sum of the applied steps' losses since the last log line (the logged loss is their mean): saved, so a run
    resumed between two log lines logs the same mean as one that never stopped."""
    loss_steps: int = 0

    def add_loss(self, loss: float) -> None:
        self.loss_sum += loss
        self.loss_steps += 1

    def take_mean_loss(self, fallback: float) -> float:
        """The mean loss since the last log line (``fallback`` when no step was applied), and a fresh interval."""
        mean = self.loss_sum / self.loss_steps if self.loss_steps else fallback
        self.loss_sum, self.loss_steps = 0.0, 0
        return mean

    def state_dict(self) -> dict[str, Any]:
        # RNG states are per rank; the checkpoint manager stores this state under a rank-unique key.
        state: dict[str, Any] = {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "tokens_seen": torch.tensor(self.tokens_seen, dtype=torch.int64),
            "loss_sum": torch.tensor(self.loss_sum, dtype=torch.float64),
            "loss_steps": torch.tensor(self.loss_steps, dtype=torch.int64),
            "torch_rng": torch.get_rng_state(),
            "python_rng": _python_rng_to_tensor(random.getstate()),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        # A checkpoint written before the logged loss was an interval mean has no interval: it starts afresh.
        self.loss_sum = float(state["loss_sum"]) if "loss_sum" in state else 0.0
        self.loss_steps = int(state["loss_steps"]) if "loss_steps" in state else 0
        torch.set_rng_state(state["torch_rng"])
        random.setstate(_python_rng_from_tensor(state["python_rng"]))
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])


def _python_rng_to_tensor(rng_state: tuple) -> torch.Tensor:
    # (version, 625 ints, gauss_next) -> int64 tensor so the state loads with weights_only=True.
    version, internal, gauss_next = rng_state
    gauss_flag = [0, 0] if gauss_next is None else [1, int.from_bytes(_float_bytes(gauss_next), "little", signed=True)]
    return torch.tensor([version, *internal, *gauss_flag], dtype=torch.int64)


def _python_rng_from_tensor(t: torch.Tensor) -> tuple:
    values = [int(v) for v in t.tolist()]
    version, internal, (has_gauss, gauss_bits) = values[0], tuple(values[1:-2]), values[-2:]
    gauss_next = _bytes_float(gauss_bits.to_bytes(8, "little", signed=True)) if has_gauss else None
    return (version, internal, gauss_next)


def _float_bytes(x: float) -> bytes:
    return struct.pack("<d", x)


def _bytes_float(b: bytes) -> float:
    return struct.unpack("<d", b)[0]
