"""The Linear the float8_blockwise converter swaps in: blockwise FP8 GEMMs (blockwise_fp8.py) for forward
and backward, emulated or on torchao's sm_90 kernels.

Like the MX Linear, it casts its input and weight to the autocast dtype first when autocast is on (what
FSDP's parameter casts deliver), so both layouts quantize the same values; the weight's gradient flows
back through the cast into the high-precision parameter. The bias is added after the GEMM, in the
output's dtype.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_lite.components.quantization.autocast_operands import autocast_operands
from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK, emulated_blockwise_linear


class BlockwiseFP8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run on 1x128 / 128x128 blockwise E4M3 operands."""

    emulate: bool = True
    """True: the GEMMs on dequantized tiles (any device); False: torchao's blockwise kernels (sm_90)."""
    power_of_2: bool = False
    """Scales rounded down to powers of two (DeepSeek-V3); emulated only."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input, weight = autocast_operands(input, self.weight)
        if self.emulate:
            output = emulated_blockwise_linear(input, weight, power_of_2=self.power_of_2)
        else:
            from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

            output = fp8_blockwise_mm.apply(input, weight, BLOCK, torch.bfloat16, False)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def blockwise_linear_from(linear: nn.Linear, *, emulate: bool, power_of_2: bool) -> BlockwiseFP8Linear:
    """A BlockwiseFP8Linear holding ``linear``'s parameters (the same Parameter objects: ties survive)."""
    with torch.device("meta"):
        new = BlockwiseFP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    new.weight = linear.weight
    new.bias = linear.bias
    new.emulate = emulate
    new.power_of_2 = power_of_2
    return new
