"""Weight-initialisation helper shared by every family's modules."""
from __future__ import annotations

import torch
from torch import nn

TRUNCATION_STDS = 3.0
"""Truncated normals are cut at this many standard deviations: nn.init's default absolute cut at +-2 would
never trigger at the small stds used here."""


def trunc_normal_(weight: torch.Tensor, std: float) -> torch.Tensor:
    """In-place normal(0, std) truncated at +-TRUNCATION_STDS * std (works on DTensor parameters too)."""
    cutoff = TRUNCATION_STDS * std
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff, b=cutoff)
