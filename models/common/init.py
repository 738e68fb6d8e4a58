"""Weight-initialisation helper shared by every family's modules."""
from __future__ import annotations

import torch

TRUNCATION_STDS = 3.0
"""Truncated normals are cut at this many standard deviations: nn.init's default absolute cut at +-2 would
never trigger at the small stds used here."""


@torch.no_grad()
def trunc_normal_(weight: torch.Tensor, std: float) -> torch.Tensor:
    """In-place normal(0, std) truncated at +-TRUNCATION_STDS * std (works on DTensor parameters too).

    Sampled here rather than by ``nn.init.trunc_normal_``, whose algorithm changed between the supported torch
    releases (torch 2.11: inverse CDF of a uniform draw; torch 2.13: normal draws, the ones outside the cut drawn
    again), so that one seed gives the same weights on every release. This is torch 2.13's algorithm for a cut
    keeping more than 30% of the mass (+-3 std keep 99.7%), draw for draw: the same weights as its nn.init."""
    if weight.is_meta:  # no storage to fill
        return weight
    # The cut in the weight's dtype, so that the test below agrees with the values it can hold.
    cutoff = weight.new_tensor(TRUNCATION_STDS * std, device="cpu").item()
    result = weight.normal_(0.0, std)
    while (outside := (result < -cutoff) | (result > cutoff)).any():
        result = torch.where(outside, torch.empty_like(result).normal_(0.0, std), result)
    if result is not weight:
        weight.copy_(result)
    return weight
