"""Llama 3.1 rotary frequency scaling: the settings the rotary table (models/common/attention/rope.py) applies."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 rotary frequency scaling (HF `rope_type: llama3`).

    Wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept, those longer
    than original_max_position_embeddings / low_freq_factor are divided by `factor`, and the band between
    is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be >= 1 (1 means no scaling)")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got low_freq_factor="
                f"{self.low_freq_factor}, high_freq_factor={self.high_freq_factor}; Llama 3.1 uses 1 and 4"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings} "
                "must be positive; Llama 3.1 uses 8192"
            )
