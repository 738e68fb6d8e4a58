"""Operands of a swapped Linear in the dtype autocast would have given an nn.Linear."""
from __future__ import annotations

import torch


def autocast_operands(input: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``input`` and ``weight`` cast to the autocast dtype when autocast is on for their device (autocast
    does not cover the custom GEMMs of low-precision Linears), unchanged otherwise."""
    device_type = input.device.type
    if not torch.is_autocast_enabled(device_type):
        return input, weight
    dtype = torch.get_autocast_dtype(device_type)
    return input.to(dtype), weight.to(dtype)
