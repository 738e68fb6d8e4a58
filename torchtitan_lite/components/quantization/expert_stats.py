"""The casts of a converted expert grouped GEMM, laid out for cast_health's measurement (used by fp8_stats).

An expert weight ``w_t`` [E, K, N] and its grouped GEMMs cast (grouped_gemm.py):

- ``input`` x [M, K] and ``grad_output`` g [M, N]: per token (rowwise), in blocks of 32 along the row (MX) or in
  1x128 tiles along it (blockwise);
- ``weight``: per expert output column along K, i.e. the rows of [E*N, K] (blockwise: 128x128 blocks of it, which
  the input-gradient GEMM reads too);
- ``weight_gi`` (input-gradient GEMM): per expert input column along N, i.e. the rows of [E*K, N];
- ``input_gw`` / ``grad_output_gw`` (weight-gradient GEMM): per token group and column (rowwise) or blocks of 32
  tokens down each column of a group (MX; a group is padded with zero rows to 32, and those padding elements are
  taken off the element count: a zero is never saturated or flushed); blockwise: tiles of 128 tokens down each
  column of a group (the group's last tile scaled over its real tokens, as the zero padding leaves its amax).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from torchtitan_lite.components.quantization.cast_health import MX_BLOCK, Cast, blockwise_cast_list, measure_cast
from torchtitan_lite.components.quantization.grouped_gemm import QuantizedGroupedMM
from torchtitan_lite.protocols.grouped_experts import grouped_gemm_experts


def expert_casts(recipe: str, power_of_2: bool = False) -> list[Cast]:
    """Every cast of one expert weight's three grouped GEMMs in ``recipe`` (``power_of_2``: blockwise scales)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    if recipe == "blockwise":
        return blockwise_cast_list(power_of_2)
    e4m3 = torch.float8_e4m3fn
    names = [("input", "input", -1), ("weight", "weight", -1), ("grad_output", "grad_output", -1),
             ("weight_gi", "weight", -1), ("input_gw", "input", 0), ("grad_output_gw", "grad_output", 0)]
    if recipe == "mxfp8":
        return [Cast(name, operand, e4m3, "mx", dim, mx_mode=ScaleCalculationMode.RCEIL) for name, operand, dim in names]
    return [Cast(name, operand, e4m3, "axiswise", dim, power_of_2=True) for name, operand, dim in names]


def converted_expert_gemms(model: nn.Module) -> list[tuple[str, nn.Module, str, QuantizedGroupedMM]]:
    """(module fqn, module, weight name, its quantized grouped_mm) of every converted expert weight."""
    found = []
    for fqn, module in grouped_gemm_experts(model):
        mm = module.__dict__.get("grouped_mm")
        if isinstance(mm, QuantizedGroupedMM):
            found += [(fqn, module, name, mm) for name in type(module).grouped_gemm_weights]  # type: ignore[attr-defined]
    return found


def measure_expert_cast(cast: Cast, operand: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """float64 ``[elements, saturated, underflowed]`` of ``cast`` on an expert GEMM operand: x [M, K] or
    g [M, N] with their token groups (``offsets``), or the weight w_t [E, K, N]."""
    counts = torch.zeros(3, dtype=torch.float64, device=operand.device)
    for view, padding in _views(cast, operand, offsets):
        counts += measure_cast(cast, view)
        counts[0] -= padding
    return counts


def _views(cast: Cast, operand: torch.Tensor, offsets: torch.Tensor) -> Iterator[tuple[torch.Tensor, int]]:
    """The 2-D tensors (and their zero padding elements) that ``cast`` scales as ``measure_cast`` expects."""
    if cast.name == "weight":
        yield operand.transpose(-2, -1).reshape(-1, operand.shape[-2]), 0
    elif cast.name == "weight_gi":
        yield operand.reshape(-1, operand.shape[-1]), 0
    elif cast.dim == -1:
        yield operand, 0
    else:  # the weight-gradient casts: one token group at a time
        ends = offsets.tolist()  # a host read, on stats steps only
        for start, end in zip([0, *ends[:-1]], ends):
            group = operand[start:end]
            if not group.shape[0]:
                continue
            pad = -group.shape[0] % MX_BLOCK if cast.granularity == "mx" else 0
            if pad:
                group = torch.cat([group, group.new_zeros(pad, group.shape[1])])
            yield group, pad * group.shape[1]
