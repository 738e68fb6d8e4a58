"""RMSNorm whose weight follows the activation dtype, shared by every family."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose weight is cast to the activation dtype before the call.

    torch.rms_norm's fused kernel normalises and scales in float32 and rounds once, but it is only taken
    when input and weight share a dtype. Under autocast the weight stays float32 while activations are
    bf16/fp16, which would fall back to a slower, double-rounding path; casting the weight (as FSDP's
    mixed-precision policy does anyway) gives every precision path the same numerics.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
