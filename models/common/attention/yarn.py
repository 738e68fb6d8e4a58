"""YaRN rotary scaling (Peng et al. 2023) as DeepSeek-V3 publishes it (HF ``rope_scaling.type: yarn``).

A model pretrained with ``original_max_position_embeddings`` positions reaches ``factor`` times as many:
frequencies that turn fewer than ``beta_slow`` times over the original context are interpolated (divided
by ``factor``), those that turn more than ``beta_fast`` times are kept, and a linear ramp over the channel
pairs blends the band between. The attention logits grow sharper as a result; YaRN compensates with an
``mscale`` that multiplies the softmax scale (squared: it is applied to q and to k) and, when ``mscale``
and ``mscale_all_dim`` differ, a factor on the rotary table. Formulas and float32 operations follow
transformers' ``_compute_yarn_parameters`` (truncated correction range), which matches DeepSeek's reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    factor: float = 40.0
    """Context extension: the table reaches factor * original_max_position_embeddings positions."""
    original_max_position_embeddings: int = 4096
    """Context length of pretraining before the extension (DeepSeek-V3: 4096)."""
    beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept unscaled."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is fully interpolated."""
    mscale: float = 1.0
    """Scale of log(factor) in the rotary table's attention factor (DeepSeek-V3: 1.0)."""
    mscale_all_dim: float = 1.0
    """Scale of log(factor) in the softmax scale's correction (DeepSeek-V3: 1.0); 0 turns the correction off."""

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"yarn rope scaling: factor={self.factor} must be >= 1 (1 means no scaling)")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"yarn rope scaling: original_max_position_embeddings="
                             f"{self.original_max_position_embeddings} must be positive; DeepSeek-V3 uses 4096")
        if not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(f"yarn rope scaling needs 0 < beta_slow < beta_fast, got beta_slow={self.beta_slow}, "
                             f"beta_fast={self.beta_fast}; DeepSeek-V3 uses 1 and 32")

    @property
    def attention_factor(self) -> float:
        """Multiplies the cos / sin table (1.0 when mscale == mscale_all_dim, as in DeepSeek-V3)."""
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """Multiplies the attention's softmax scale: mscale(factor, mscale_all_dim) squared."""
        if not self.mscale_all_dim:
            return 1.0
        return _mscale(self.factor, self.mscale_all_dim) ** 2

    def hf_dict(self) -> dict[str, float | int | str]:
        """The config.json ``rope_scaling`` entry."""
        return {"type": "yarn", "rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim,
                "original_max_position_embeddings": self.original_max_position_embeddings}


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(wavelength_base: torch.Tensor, head_dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] from ``wavelength_base`` = theta ** (2i / head_dim), each blended
    between its unscaled value and its interpolation."""
    low, high = (_correction_dim(rotations, head_dim, theta, s.original_max_position_embeddings)
                 for rotations in (s.beta_fast, s.beta_slow))
    low, high = max(math.floor(low), 0), min(math.ceil(high), head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=wavelength_base.device)
    extrapolation = 1 - ((pairs - low) / (high - low)).clamp(0, 1)
    interpolated = 1.0 / (s.factor * wavelength_base)
    return interpolated * (1 - extrapolation) + (1.0 / wavelength_base) * extrapolation


def _correction_dim(rotations: float, head_dim: int, theta: float, max_positions: int) -> float:
    """The channel (pair index times 2) whose frequency turns ``rotations`` times over ``max_positions``."""
    return (head_dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))
