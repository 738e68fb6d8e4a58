"""Blockwise FP8 numerics (DeepSeek-V3): 1x128 tiles for activations and gradients, 128x128 blocks for weights.

Every tile / block gets its own scale ``448 / amax`` (E4M3's largest finite value over the tile's largest
magnitude; DeepSeek-V3 optionally rounds it down to a power of two, so that scaling is exact), the scaled
values are saturated to +-448 and cast to ``float8_e4m3fn``. The three GEMMs of a Linear ``Y = X Wᵀ``
(X: M tokens x K, W: N x K) are taken as torchao's ``prototype/blockwise_fp8_training`` arranges them:

- forward ``Y = X Wᵀ``: X in 1x128 tiles along K, W in 128x128 blocks;
- input gradient ``dX = dY W``: dY in 1x128 tiles along N, W in the same 128x128 blocks (a square block
  is the same block transposed, so one quantized weight serves both GEMMs);
- weight gradient ``dW = dYᵀ X``: both operands in 1x128 tiles along the tokens (M), the GEMM's
  reduction dim, so no scale group crosses the dim that is summed over.

``emulated_blockwise_linear`` runs the three GEMMs on the dequantized tiles: the same quantized numbers
as the FP8 kernels, multiplied in float32 (FP8 tensor cores accumulate in float32 too) and written in the
operands' dtype, so only the accumulation order differs from a real blockwise GEMM.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
BLOCK = 128
"""Elements per activation / gradient tile and per weight block side (DeepSeek-V3's choice)."""
EPS = 1e-12
"""Smallest amax a scale is computed from: an all-zero tile gets a finite scale (and stays zero)."""


def tp_degrees_keeping_blocks(split: int, tp: int) -> list[int] | None:
    """None when ``tp`` shards of a dim of ``split`` each hold whole 128-wide tiles and blocks; else the
    tensor-parallel degrees that would (for the error that names them)."""
    def fits(t: int) -> bool:
        return split % t == 0 and (split // t) % BLOCK == 0

    return None if fits(tp) else [t for t in range(1, split // BLOCK + 1) if fits(t)]


def tile_scales(amax: torch.Tensor, *, power_of_2: bool) -> torch.Tensor:
    """float32 scales ``448 / amax`` (amax at least EPS), rounded down to a power of two when asked (so the
    scaled tile's largest magnitude stays at or below 448 and the multiplication by the scale is exact)."""
    scale = (E4M3_MAX / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def scaled_saturated(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` in float32, saturated to +-448: the values the E4M3 cast rounds."""
    # Saturate explicitly (DeepSeek-V3 and torchao do): the result then does not rest on the cast's own rule
    # for values past 448 (NaN in the OCP spec's non-saturating conversion).
    return (x.to(torch.float32) * scale).clamp(-E4M3_MAX, E4M3_MAX)


def to_e4m3_saturated(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` in float8_e4m3fn, saturated to +-448."""
    return scaled_saturated(x, scale).to(torch.float8_e4m3fn)


def _tiles_1x128(x: torch.Tensor, *, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 tiles rows x ceil(cols/128) x 128, their scales rows x ceil(cols/128)) of a 2-D tensor."""
    rows, cols = x.shape
    pad = -cols % BLOCK
    padded = F.pad(x, (0, pad)) if pad else x
    tiles = padded.reshape(rows, -1, BLOCK)
    scale = tile_scales(tiles.abs().amax(dim=-1), power_of_2=power_of_2)
    return to_e4m3_saturated(tiles, scale.unsqueeze(-1)), scale


def _blocks_128x128(w: torch.Tensor, *, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 blocks N/128 x 128 x K/128 x 128, their scales N/128 x K/128) of a weight N x K."""
    n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"a 128x128-block weight needs both dims multiples of {BLOCK}, got {n} x {k}")
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = tile_scales(blocks.abs().amax(dim=(1, 3)), power_of_2=power_of_2)
    return to_e4m3_saturated(blocks, scale[:, None, :, None]), scale


def quantize_1x128(x: torch.Tensor, *, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor (rows x cols) in 1x128 tiles along its last dim: (E4M3 data of the same shape,
    float32 scales rows x ceil(cols / 128)). A last tile shorter than 128 is scaled by its own amax (zero
    padding changes neither the amax nor any product)."""
    tiles, scale = _tiles_1x128(x, power_of_2=power_of_2)
    return tiles.reshape(x.shape[0], -1)[:, :x.shape[1]], scale


def dequantize_1x128(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of 1x128-tile data (the inverse of ``quantize_1x128`` up to the E4M3 rounding)."""
    per_element = scale.repeat_interleave(BLOCK, dim=-1)[:, :data.shape[-1]]
    return data.to(torch.float32) / per_element


def quantize_128x128(w: torch.Tensor, *, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight (N x K, both multiples of 128) in 128x128 blocks: (E4M3 data N x K, float32 scales
    N/128 x K/128)."""
    blocks, scale = _blocks_128x128(w, power_of_2=power_of_2)
    return blocks.reshape(w.shape), scale


def dequantize_128x128(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of 128x128-block data."""
    per_element = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return data.to(torch.float32) / per_element


# The emulated GEMMs dequantize tile by tile (a broadcast division, no per-element scale tensor): fewer ops, and
# a form inductor's CPU code generator compiles.
def fake_1x128(x: torch.Tensor, *, power_of_2: bool) -> torch.Tensor:
    """``x`` quantized in 1x128 tiles along its last dim and dequantized (float32)."""
    tiles, scale = _tiles_1x128(x, power_of_2=power_of_2)
    return (tiles.to(torch.float32) / scale.unsqueeze(-1)).reshape(x.shape[0], -1)[:, :x.shape[1]]


def fake_128x128(w: torch.Tensor, *, power_of_2: bool) -> torch.Tensor:
    """``w`` quantized in 128x128 blocks and dequantized (float32)."""
    blocks, scale = _blocks_128x128(w, power_of_2=power_of_2)
    return (blocks.to(torch.float32) / scale[:, None, :, None]).reshape(w.shape)


class _EmulatedBlockwiseMatmul(torch.autograd.Function):
    """``x @ weightᵀ`` (x: M x K) with the three GEMMs on blockwise-quantized operands (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, power_of_2: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.power_of_2 = power_of_2
        # The products run in float32 whatever autocast says: the FP8 GEMM accumulates in float32.
        with torch.autocast(x.device.type, enabled=False):
            out = fake_1x128(x, power_of_2=power_of_2) @ fake_128x128(weight, power_of_2=power_of_2).t()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        p2 = ctx.power_of_2
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_out = grad_out.contiguous()
            # dX = dY W: dY in 1x128 tiles along N, W in the forward's 128x128 blocks.
            grad_x = fake_1x128(grad_out, power_of_2=p2) @ fake_128x128(weight, power_of_2=p2)
            # dW = dYᵀ X: both in 1x128 tiles along the tokens (rows of dYᵀ and of Xᵀ).
            grad_w = fake_1x128(grad_out.t(), power_of_2=p2) @ fake_1x128(x.t(), power_of_2=p2).t()
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class _EmulatedPrequantizedMatmul(torch.autograd.Function):
    """``_EmulatedBlockwiseMatmul`` with the weight already in 128x128 blocks (``data``, ``scale``): FSDP's FP8
    all-gather delivered them (blockwise_weight.py). ``weight`` is the gathered parameter, taken for its gradient
    only; forward and input gradient dequantize the same blocks, so nothing is quantized twice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                power_of_2: bool) -> torch.Tensor:
        ctx.save_for_backward(x, data, scale)
        ctx.power_of_2 = power_of_2
        ctx.weight_dtype = weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            out = fake_1x128(x, power_of_2=power_of_2) @ dequantize_128x128(data, scale).t()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        x, data, scale = ctx.saved_tensors
        p2 = ctx.power_of_2
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_out = grad_out.contiguous()
            grad_x = fake_1x128(grad_out, power_of_2=p2) @ dequantize_128x128(data, scale)
            grad_w = fake_1x128(grad_out.t(), power_of_2=p2) @ fake_1x128(x.t(), power_of_2=p2).t()
        return grad_x.to(x.dtype), grad_w.to(ctx.weight_dtype), None, None, None


def emulated_blockwise_linear(x: torch.Tensor, weight: torch.Tensor, *, power_of_2: bool) -> torch.Tensor:
    """``x @ weightᵀ`` for x of any leading shape, the three GEMMs emulated on blockwise-quantized tiles. A
    ``weight`` gathered by FSDP as FP8 blocks (it has ``_data`` and ``_scale``) is used as it came."""
    rows = x.reshape(-1, x.shape[-1])
    data, scale = getattr(weight, "_data", None), getattr(weight, "_scale", None)
    if data is not None and scale is not None:
        out = _EmulatedPrequantizedMatmul.apply(rows, weight, data, scale, power_of_2)
    else:
        out = _EmulatedBlockwiseMatmul.apply(rows, weight, power_of_2)
    return out.reshape(*x.shape[:-1], weight.shape[0])
