"""What one FP8 / MX cast does to a tensor: how many elements it saturates and how many it flushes to zero.

Each cast a converted Linear performs is reproduced as torchao performs it: the same operand in the
same layout, the same target format (e4m3 / e5m2), the same scale granularity, and torchao's own
scale arithmetic (``amax_to_scale`` with its power-of-2 rounding for float8, the reference ``to_mx``
with the layer's e8m0 rounding mode for MX, the blockwise recipe's own ``quantize_1x128`` /
``quantize_128x128`` for blockwise FP8). Operands are walked in row chunks, so the extra memory is a
few chunks of float32 whatever the tensor's size.

Per cast, over the operand's elements:

- **saturated**: ``|x * scale|`` beyond the format's largest finite value by more than rounding,
  i.e. at least ``max + ulp(max) / 2`` (464 for e4m3, 61440 for e5m2). The cast clamps these to
  ``max``: their error exceeds what rounding to the nearest representable value gives. (With amax
  scaling the largest element lands exactly on ``max``; counting ``>= max`` would flag every tensor.)
- **underflowed**: nonzero ``x`` whose cast is exactly 0 (``|x * scale|`` below half the smallest
  subnormal, 2^-10 for e4m3, 2^-17 for e5m2): the element is lost, not just rounded.

Operands are arranged as 2-D tensors: input ``[tokens, in]``, weight ``[out, in]``, output gradient
``[tokens, out]``. A cast groups its scales along the last dim (``dim=-1``: one scale per row, or MX
blocks of 32 along a row) or along the first (``dim=0``: per column, or blocks down a column), which is
how each of the three GEMMs of forward and backward consumes the operand. Blockwise casts group
1x128 tiles the same way, or 128x128 blocks (the weight's, one cast for both GEMMs that read it).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK, quantize_1x128, quantize_128x128

OPERANDS = ("input", "weight", "grad_output")
CHUNK_ELEMENTS = 1 << 24
"""Elements per row chunk: 64 MiB of float32 per temporary."""
MX_BLOCK = 32
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, torch.float8_e4m3fnuz: 3, torch.float8_e5m2fnuz: 2}
_FORMAT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.float8_e4m3fnuz: "e4m3fnuz",
           torch.float8_e5m2fnuz: "e5m2fnuz"}
Granularity = Literal["tensorwise", "axiswise", "mx", "tile", "block"]


@dataclass(frozen=True)
class Cast:
    """One cast of one operand of a converted Linear."""

    name: str
    """'input', 'weight', 'grad_output' (the forward GEMM and the input-gradient GEMM), or the extra casts of
    recipes that scale the other GEMMs differently: 'input_gw', 'grad_output_gw' (weight-gradient GEMM),
    'weight_gi' (input-gradient GEMM)."""
    operand: str
    dtype: torch.dtype
    granularity: Granularity
    dim: int
    """-1: scales grouped along each row (per row, or MX blocks along it); 0: along each column."""
    power_of_2: bool = False
    """Float8 scales rounded down to a power of 2 (torchao's rowwise recipes, blockwise with power_of_2_scales)."""
    mx_mode: Any = None
    """torchao ScaleCalculationMode of an MX cast (how the e8m0 block scale is rounded)."""

    def describe(self) -> str:
        fmt = _FORMAT.get(self.dtype, str(self.dtype))
        if self.granularity == "tensorwise":
            return f"{fmt} tensorwise"
        if self.granularity == "mx":
            mode = getattr(self.mx_mode, "value", self.mx_mode)
            return f"{fmt} MX blocks of {MX_BLOCK} along {'rows' if self.dim == -1 else 'columns'} ({mode})"
        pow2 = ", power-of-2 scales" if self.power_of_2 else ""
        if self.granularity == "tile":
            return f"{fmt} 1x{BLOCK} tiles along {'rows' if self.dim == -1 else 'columns'}{pow2}"
        if self.granularity == "block":
            return f"{fmt} {BLOCK}x{BLOCK} blocks{pow2}"
        return f"{fmt} per {'row' if self.dim == -1 else 'column'}{pow2}"


def float8_casts(config: Any) -> list[Cast]:
    """The distinct casts a torchao ``Float8Linear`` with ``config`` (Float8LinearConfig) performs.

    A second cast of an operand (for another GEMM) is listed only when it differs from the first: a
    tensorwise cast with the same config is the same cast whichever GEMM reads it.
    """
    from torchao.float8.config import ScalingGranularity, ScalingType

    c = config
    candidates = [
        ("input", "input", -1, c.cast_config_input),
        ("weight", "weight", -1, c.cast_config_weight),
        ("grad_output", "grad_output", -1, c.cast_config_grad_output),
        ("input_gw", "input", 0, c.cast_config_input_for_grad_weight),
        ("weight_gi", "weight", 0, c.cast_config_weight_for_grad_input),
        ("grad_output_gw", "grad_output", 0, c.cast_config_grad_output_for_grad_weight),
    ]
    primary = {operand: cast_config for name, operand, _, cast_config in candidates if name == operand}
    casts = []
    for name, operand, dim, cast_config in candidates:
        if cast_config.scaling_type is ScalingType.DISABLED:
            continue  # this GEMM reads the operand in high precision
        tensorwise = cast_config.scaling_granularity is ScalingGranularity.TENSORWISE
        if name != operand and tensorwise and cast_config == primary[operand]:
            continue
        casts.append(Cast(name, operand, cast_config.target_dtype, "tensorwise" if tensorwise else "axiswise",
                          dim, power_of_2=c.round_scales_to_power_of_2 and not tensorwise))
    return casts


def mx_casts(module: nn.Module) -> list[Cast]:
    """The casts of torchao's ``MXFP8Linear`` (torchao.prototype.moe_training.mxfp8_linear.mx_mm): e4m3
    elements in blocks of 32 with e8m0 scales, along the GEMM's reduction dim; the weight-gradient GEMM's
    two casts only when it is not computed in high precision (``wgrad_with_hp``)."""
    mode = module.scale_calculation_mode
    e4m3 = torch.float8_e4m3fn
    casts = [Cast("input", "input", e4m3, "mx", -1, mx_mode=mode),
             Cast("weight", "weight", e4m3, "mx", -1, mx_mode=mode),
             Cast("grad_output", "grad_output", e4m3, "mx", -1, mx_mode=mode),
             Cast("weight_gi", "weight", e4m3, "mx", 0, mx_mode=mode)]
    if not module.wgrad_with_hp:
        casts += [Cast("grad_output_gw", "grad_output", e4m3, "mx", 0, mx_mode=mode),
                  Cast("input_gw", "input", e4m3, "mx", 0, mx_mode=mode)]
    return casts


def blockwise_casts(module: nn.Module) -> list[Cast]:
    """The casts of a ``BlockwiseFP8Linear`` (blockwise_fp8.py), all e4m3: the forward reads the input in 1x128
    tiles along its features and the weight in 128x128 blocks; the input-gradient GEMM the output gradient in
    1x128 tiles along its features and the same weight blocks (no second weight cast); the weight-gradient GEMM
    both the output gradient and the input in 1x128 tiles along the tokens (down the columns)."""
    return blockwise_cast_list(bool(module.power_of_2))


def blockwise_cast_list(power_of_2: bool) -> list[Cast]:
    """The blockwise casts (``blockwise_casts``), also those of a blockwise expert weight's grouped GEMMs."""
    e4m3, p2 = torch.float8_e4m3fn, power_of_2
    return [Cast("input", "input", e4m3, "tile", -1, power_of_2=p2),
            Cast("weight", "weight", e4m3, "block", -1, power_of_2=p2),
            Cast("grad_output", "grad_output", e4m3, "tile", -1, power_of_2=p2),
            Cast("grad_output_gw", "grad_output", e4m3, "tile", 0, power_of_2=p2),
            Cast("input_gw", "input", e4m3, "tile", 0, power_of_2=p2)]


def saturation_threshold(dtype: torch.dtype) -> float:
    """``max + ulp(max) / 2``: the smallest scaled magnitude that rounding alone would not bring to ``max``."""
    top = torch.finfo(dtype).max
    return top + 2.0 ** (math.floor(math.log2(top)) - _MANTISSA_BITS[dtype] - 1)


# --------------------------------------------------------------------------------------------------
# Measurement


def measure_cast(cast: Cast, x: torch.Tensor) -> torch.Tensor:
    """float64 ``[elements, saturated, underflowed]`` of ``cast`` applied to the 2-D operand ``x``."""
    if x.dim() != 2:
        raise ValueError(f"measure_cast takes the operand as a 2-D tensor, got shape {tuple(x.shape)}")
    counts = torch.zeros(3, dtype=torch.float64, device=x.device)
    threshold = saturation_threshold(cast.dtype)
    if cast.granularity == "mx":
        _measure_mx(cast, x, counts, threshold)
        return counts
    if cast.granularity in ("tile", "block"):
        _measure_blockwise(cast, x, counts, threshold)
        return counts
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    whole = None
    if cast.granularity == "tensorwise":
        whole = amax_to_scale(operand_amax(x), cast.dtype, cast.power_of_2)
    elif cast.dim == 0:
        whole = amax_to_scale(_column_amax(x), cast.dtype, cast.power_of_2)
    for chunk in row_chunks(x, rows_per_chunk(x)):
        scale = whole
        if scale is None:  # per-row scales: each row's amax lies within the chunk
            scale = amax_to_scale(chunk.abs().amax(dim=-1, keepdim=True), cast.dtype, cast.power_of_2)
        # As torchao's _ToFloat8ConstrFunc: upcast, multiply by the scale, clamp-cast.
        scaled = chunk.to(torch.float32) * scale
        _count(counts, chunk, scaled, to_fp8_saturated(scaled, cast.dtype), threshold)
    return counts


def operand_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float64 scalar tensor (no host sync), computed chunk by chunk."""
    amax = torch.zeros((), dtype=torch.float64, device=x.device)
    for chunk in row_chunks(x, rows_per_chunk(x)):
        amax = torch.maximum(amax, chunk.abs().amax().to(torch.float64))
    return amax


def _column_amax(x: torch.Tensor) -> torch.Tensor:
    amax = torch.zeros((1, x.shape[1]), dtype=x.dtype, device=x.device)
    for chunk in row_chunks(x, rows_per_chunk(x)):
        amax = torch.maximum(amax, chunk.abs().amax(dim=0, keepdim=True))
    return amax


def _measure_mx(cast: Cast, x: torch.Tensor, counts: torch.Tensor, threshold: float) -> None:
    from torchao.prototype.mx_formats.constants import F32_MIN_NORMAL
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    rows = rows_per_chunk(x)
    if cast.dim == 0:  # blocks run down the columns: a chunk must hold whole blocks
        rows = max(MX_BLOCK, rows // MX_BLOCK * MX_BLOCK)
    for chunk in row_chunks(x, rows):
        data = (chunk if cast.dim == -1 else chunk.t()).contiguous()
        scale_e8m0, quantized = to_mx(data, cast.dtype, MX_BLOCK, cast.mx_mode)
        blocks = data.to(torch.float32).reshape(*data.shape[:-1], -1, MX_BLOCK)
        block_scale = get_fp_scale(scale_e8m0).clamp(min=F32_MIN_NORMAL).unsqueeze(-1)
        _count(counts, data, (blocks / block_scale).reshape(data.shape), quantized, threshold)


def _measure_blockwise(cast: Cast, x: torch.Tensor, counts: torch.Tensor, threshold: float) -> None:
    # Chunks of whole 128-row groups: a weight block or a tile down a column lies within one chunk, and the
    # last chunk's short tiles are padded exactly as the emulated GEMMs pad them.
    rows = max(BLOCK, rows_per_chunk(x) // BLOCK * BLOCK)
    for chunk in row_chunks(x, rows):
        if cast.granularity == "block":
            quantized, scale = quantize_128x128(chunk, power_of_2=cast.power_of_2)
            per_element = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
            data = chunk
        else:
            data = chunk if cast.dim == -1 else chunk.t()
            quantized, scale = quantize_1x128(data, power_of_2=cast.power_of_2)
            per_element = scale.repeat_interleave(BLOCK, dim=-1)[:, :data.shape[-1]]
        _count(counts, data, data.to(torch.float32) * per_element, quantized, threshold)


def _count(counts: torch.Tensor, original: torch.Tensor, scaled: torch.Tensor, quantized: torch.Tensor,
           threshold: float) -> None:
    counts[0] += original.numel()
    counts[1] += (scaled.abs() >= threshold).sum()
    counts[2] += ((original != 0) & (quantized.to(torch.float32) == 0)).sum()


def rows_per_chunk(x: torch.Tensor) -> int:
    """Rows of the 2-D ``x`` per chunk: about CHUNK_ELEMENTS elements."""
    return max(1, CHUNK_ELEMENTS // max(1, x.shape[-1]))


def row_chunks(x: torch.Tensor, rows: int) -> Iterator[torch.Tensor]:
    """Consecutive views of ``rows`` rows of ``x`` (the last one shorter)."""
    for start in range(0, x.shape[0], rows):
        yield x[start:start + rows]
