"""The Linear the float8_blockwise converter swaps in: blockwise FP8 GEMMs (blockwise_fp8.py) for forward
and backward, emulated or on torchao's sm_90 kernels.

Like the MX Linear, it casts its input and weight to the autocast dtype first when autocast is on (what
FSDP's parameter casts deliver), so both layouts quantize the same values; the weight's gradient flows
back through the cast into the high-precision parameter. The bias is added after the GEMM, in the
output's dtype.

Under tensor parallelism the weight is a DTensor, column-wise (Shard(0), input replicated), row-wise
(Shard(1), input sharded along its last dim) or replicated (a module every rank runs whole, input
replicated). The converter has checked that every TP shard holds whole 128-element tiles and blocks, so the
GEMMs run on the local shards (the tiles of a shard are tiles of the whole operand) and the output is the
matching DTensor: sharded along its last dim, partial sums, or replicated.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchtitan_lite.compat import dtensor_from_local
from torchtitan_lite.components.quantization.autocast_operands import autocast_operands
from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK, emulated_blockwise_linear


class BlockwiseFP8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run on 1x128 / 128x128 blockwise E4M3 operands."""

    emulate: bool = True
    """True: the GEMMs on dequantized tiles (any device); False: torchao's blockwise kernels (sm_90)."""
    power_of_2: bool = False
    """Scales rounded down to powers of two (DeepSeek-V3); emulated only."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        input, cast_weight = autocast_operands(input, weight)
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        # A weight FSDP gathered as FP8 blocks (blockwise_weight.py) is used as it came: the blocks are the
        # quantization of the parameter-dtype weight already.
        weight = weight if hasattr(local, "_data") else cast_weight
        if isinstance(weight, DTensor):
            output = self._tp_gemm(input, weight)
        else:
            output = self._gemm(input, weight)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    def _gemm(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.emulate:
            return emulated_blockwise_linear(input, weight, power_of_2=self.power_of_2)
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        return fp8_blockwise_mm.apply(input, weight, BLOCK, torch.bfloat16, False)

    def _tp_gemm(self, input: torch.Tensor, weight: DTensor) -> torch.Tensor:
        if not isinstance(input, DTensor):
            raise TypeError("a tensor-parallel BlockwiseFP8Linear expects a DTensor input (from its TP style)")
        (w_place,), (x_place,) = weight.placements, input.placements
        last = input.ndim - 1
        if w_place.is_replicate() and x_place.is_replicate():
            # Replicated (replicated_modules.py): the output's gradient is each rank's share, so are the
            # input's and the weight's.
            share = (Partial(),)
            local = self._gemm(input.to_local(grad_placements=share), weight.to_local(grad_placements=share))
            return dtensor_from_local(local, weight.device_mesh, (Replicate(),), grad_placements=share)
        if w_place == Shard(0) and x_place.is_replicate():
            out_place: Shard | Partial = Shard(last)  # column-wise: each rank has its output features
        elif w_place == Shard(1) and (x_place == Shard(-1) or x_place == Shard(last)):
            out_place = Partial()  # row-wise: each rank sums over its share of the input features
        else:
            raise NotImplementedError(f"BlockwiseFP8Linear under TP takes a column-wise (Shard(0)) weight with a "
                                      f"replicated input, a row-wise (Shard(1)) one with an input sharded on its "
                                      f"last dim or a replicated one with a replicated input; got weight "
                                      f"{weight.placements}, input {input.placements}")
        # Column-wise, each rank's input gradient covers only its output features: partial sums over TP ranks.
        grad_place = (Partial(),) if isinstance(out_place, Shard) else input.placements
        local = self._gemm(input.to_local(grad_placements=grad_place), weight.to_local())
        return DTensor.from_local(local, weight.device_mesh, (out_place,), run_check=False)


def blockwise_linear_from(linear: nn.Linear, *, emulate: bool, power_of_2: bool) -> BlockwiseFP8Linear:
    """A BlockwiseFP8Linear holding ``linear``'s parameters (the same Parameter objects: ties survive)."""
    with torch.device("meta"):
        new = BlockwiseFP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    new.weight = linear.weight
    new.bias = linear.bias
    new.emulate = emulate
    new.power_of_2 = power_of_2
    return new
