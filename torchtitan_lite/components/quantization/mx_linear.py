"""The MX Linear module the mx converter swaps in: torchao 0.18's ``MXFP8Linear`` that follows autocast.

torchao's ``MXFP8Linear`` quantizes whatever dtype its input and weight arrive in. Under FSDP's mixed
precision both arrive in bfloat16; without FSDP the trainer computes in low precision through
``torch.autocast``, which does not reach inside torchao's autograd function, so the GEMMs would
quantize float32 operands and write float32. Here the operands are cast to the autocast dtype first,
as FSDP would have delivered them, so both layouts quantize the same bfloat16 values and produce
bfloat16 outputs (the weight's gradient flows back through the cast into the float32 parameter).

Loaded lazily: importing torchao's prototype MX modules is only needed when MX is configured.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, _to_mxfp8_then_scaled_mm
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from torchtitan_lite.components.quantization.autocast_operands import autocast_operands


class MXLinear(MXFP8Linear):
    """MXFP8 forward and backward GEMMs (torchao), with operands in the autocast dtype when autocast is on."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input, weight = autocast_operands(input, self.weight)
        output = _to_mxfp8_then_scaled_mm(input, weight, kernel_preference=self.kernel_preference,
                                          scale_calculation_mode=self.scale_calculation_mode,
                                          wgrad_with_hp=self.wgrad_with_hp)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def mx_linear_from(linear: nn.Linear, *, emulate: bool, wgrad_with_hp: bool) -> MXLinear:
    """An MXLinear that holds ``linear``'s parameters (the same Parameter objects: ties survive)."""
    with torch.device("meta"):
        mx = MXLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                      kernel_preference=KernelPreference.EMULATED if emulate else KernelPreference.AUTO,
                      scale_calculation_mode=ScaleCalculationMode.RCEIL, wgrad_with_hp=wgrad_with_hp)
    mx.weight = linear.weight
    mx.bias = linear.bias
    return mx
