"""FP8 rowwise, MXFP8 and blockwise FP8 grouped GEMMs of routed experts: torchao 0.18's moe_training kernels, or
their emulation.

A grouped GEMM computes ``x [M, K] @ w_t [E, K, N]`` per token group (rows ``offsets[e-1]:offsets[e]`` use
expert e). Training runs three of them per expert weight, and each recipe quantizes the operands of each
exactly as torchao's ``torchao.prototype.moe_training`` does:

FP8 rowwise (``_to_fp8_rowwise_then_scaled_grouped_mm``; e4m3 everywhere, scales rounded down to a power of 2):

- output ``x @ w_t``: one scale per token (amax along K) and one per expert and output column (amax along K);
- input gradient ``g @ w_t^T``: one scale per token of ``g`` (along N), one per expert and input column of the
  weight (along N);
- weight gradient ``g^T @ x`` per group: one scale per token group and column of ``g`` and of ``x`` (amax over
  the group's tokens).

MXFP8 (``_to_mxfp8_then_scaled_grouped_mm``, RCEIL e8m0 scales): e4m3 elements in blocks of 32 consecutive
elements along each GEMM's contraction dim: K for the output, N for the input gradient, and the tokens for
the weight gradient.

Blockwise FP8 (DeepSeek-V3; torchao 0.18's ``_to_fp8_blockwise_then_scaled_grouped_mm``, whose GEMMs run on
DeepGEMM, or its emulation): each expert's GEMMs exactly as the dense blockwise recipe's (blockwise_fp8.py), e4m3
with float32 scales 448 / amax (torchao's, equal to ours tile for tile: tests/unit/test_blockwise_grouped_tiles.py)
or, emulated only, power-of-2 ones:

- output ``x @ w_t[e]``: x in 1x128 tiles along K, each expert's weight in 128x128 blocks;
- input gradient ``g @ w_t[e]^T``: g in 1x128 tiles along N, the same weight blocks;
- weight gradient ``g^T @ x`` per expert: g and x in tiles of 128 tokens along the token dim.

Token groups are padded with zero rows to the kernels' alignment (16 rows for FP8 rowwise, 32 for MXFP8, 128
for blockwise, ``GROUP_ALIGNMENT``) before the GEMMs: the grouped FP8 kernels need each group to start at a
multiple of it, and the weight-gradient blocks of 32 (MXFP8) or 128 (blockwise) tokens must not straddle two
experts. torchao 0.18's own padding option is unimplemented for FP8 rowwise, so the padding is done here for
every recipe, in plain torch ops with no host synchronisation (the buffer has the upper bound of rows; rows
past the last group are never read).

Emulation quantizes and dequantizes exactly those tiles with torchao's own scale arithmetic (``amax_to_scale``
with power-of-2 rounding and ``to_fp8_saturated`` for rowwise, ``to_mx`` for MXFP8, ``448 / amax`` in float64
rounded to float32 for blockwise, as torchao's blockwise quantizers) and multiplies the dequantized operands in
the compute dtype with ``torch._grouped_mm``. Every dequantized element is an e4m3 value times a power of 2, exact
in bfloat16 and float32, so emulation differs from the FP8 tensor cores only in the order of the float32
accumulation. Blockwise with power-of-2 scales is exact in bfloat16 the same way and multiplies in the compute
dtype (a bfloat16 grouped GEMM: compiled with its block, no host synchronisation). Blockwise float32 scales give
dequantized values that bfloat16 cannot hold, so then it multiplies in float32 (as the dense blockwise emulation
does, and as DeepGEMM applies float32 scales to float32 partial sums) and writes the compute dtype;
torch._grouped_mm's traced form takes bfloat16 only, so that GEMM runs eagerly inside compiled blocks, and on a
GPU a float32 torch._grouped_mm is torch's fallback: one mm per expert, after reading the offsets on the host.
torchao's own emulated backend (its fallback without DeepGEMM, not used here) rounds each dequantized operand to
bfloat16 instead (``e4m3 * bfloat16(1 / scale)``), about 2^-8 relative per element.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK, fake_1x128, fake_128x128

GroupedRecipe = Literal["rowwise", "mxfp8", "blockwise"]
GROUPED_RECIPES: tuple[str, ...] = ("rowwise", "mxfp8", "blockwise")
GROUP_ALIGNMENT = {"rowwise": 16, "mxfp8": 32, "blockwise": BLOCK}
"""Rows each token group is padded to a multiple of: torch._scaled_grouped_mm's FP8 row alignment (16), the
MX block (32) and the blockwise weight gradient's token tile (128)."""
MX_BLOCK = 32
E4M3 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------------------
# Token-group padding


@dataclass(frozen=True)
class PaddedGroups:
    rows: torch.Tensor
    """[M] int64: where each original row sits in the padded buffer."""
    offsets: torch.Tensor
    """[E] int32 cumulative ends of the padded groups (each group a multiple of the alignment)."""
    total_rows: int
    """Rows of the padded buffer: the upper bound M + E * (alignment - 1), rounded up to the alignment."""


def pad_groups(offsets: torch.Tensor, num_rows: int, alignment: int) -> PaddedGroups:
    """The padded layout of ``num_rows`` rows grouped by ``offsets`` (int cumulative ends, [E])."""
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_counts = (counts + alignment - 1) // alignment * alignment
    padded_ends = torch.cumsum(padded_counts, dim=0)
    shift = (padded_ends - padded_counts) - (ends - counts)  # padded start - start, per group
    index = torch.arange(num_rows, device=offsets.device)
    group = torch.bucketize(index, ends, right=True).clamp(max=ends.numel() - 1)
    total = -(-(num_rows + ends.numel() * (alignment - 1)) // alignment) * alignment
    return PaddedGroups(rows=index + shift[group], offsets=padded_ends.to(torch.int32), total_rows=total)


def pad_rows(x: torch.Tensor, layout: PaddedGroups) -> torch.Tensor:
    """``x`` [M, K] in the padded layout [total_rows, K], zeros between groups (differentiable)."""
    return x.new_zeros(layout.total_rows, x.shape[1]).index_copy(0, layout.rows, x)


def unpad_rows(x: torch.Tensor, layout: PaddedGroups) -> torch.Tensor:
    return x.index_select(0, layout.rows)


def group_of_rows(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int64 group of each row; rows past the last group get E (one past the last expert)."""
    return torch.bucketize(torch.arange(num_rows, device=offsets.device), offsets.long(), right=True)


# --------------------------------------------------------------------------------------------------
# The quantized tiles (dequantized to float32)


def fp8_scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` cast to e4m3 with ``scale`` (torchao: upcast, multiply, saturating cast), back in float32."""
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(x.float() * scale, E4M3).float() / scale


def fp8_rowwise(x: torch.Tensor, dim: int) -> torch.Tensor:
    """e4m3 with one power-of-2 scale per slice along ``dim`` (its amax), as torchao's axiswise casts."""
    from torchao.float8.float8_utils import amax_to_scale

    scale = amax_to_scale(x.abs().amax(dim=dim, keepdim=True).float(), E4M3, round_scales_to_power_of_2=True)
    return fp8_scaled(x, scale)


def fp8_per_group_columns(x: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """e4m3 of ``x`` [M, C] with one power-of-2 scale per (token group, column): the weight-gradient casts.
    ``group`` [M] is each row's group (``num_groups`` for rows past the last group, which are zero)."""
    from torchao.float8.float8_utils import amax_to_scale

    index = group.unsqueeze(1).expand_as(x)
    amax = x.new_zeros(num_groups + 1, x.shape[1], dtype=torch.float32).scatter_reduce(
        0, index, x.abs().float(), reduce="amax")
    scale = amax_to_scale(amax, E4M3, round_scales_to_power_of_2=True)
    return fp8_scaled(x, scale.index_select(0, group))


def mx_blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """MXFP8 of ``x``: e4m3 in blocks of 32 along ``dim`` with RCEIL e8m0 scales (torchao ``to_mx``)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    moved = x.movedim(dim, -1).contiguous()
    scale, data = to_mx(moved, E4M3, MX_BLOCK, ScaleCalculationMode.RCEIL)
    blocks = data.float().reshape(*moved.shape[:-1], -1, MX_BLOCK) * get_fp_scale(scale).unsqueeze(-1)
    return blocks.reshape(moved.shape).movedim(-1, dim)


@dataclass(frozen=True)
class GroupedTiles:
    """How one recipe quantizes the operands of the three grouped GEMMs (all dequantized to float32)."""

    forward_input: Callable[[torch.Tensor], torch.Tensor]
    """x [M, K] of the output GEMM."""
    forward_weight: Callable[[torch.Tensor], torch.Tensor]
    """w_t [E, K, N] of the output GEMM."""
    grad_output: Callable[[torch.Tensor], torch.Tensor]
    """g [M, N] of the input-gradient GEMM."""
    grad_input_weight: Callable[[torch.Tensor], torch.Tensor]
    """w_t [E, K, N] of the input-gradient GEMM (returned as w_t: the caller transposes)."""
    weight_grad_operand: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    """g [M, N] or x [M, K] of the weight-gradient GEMM, with each row's group and the number of groups."""
    float32_gemm: bool = False
    """Multiply the dequantized operands in float32 (they are not all exact in the compute dtype)."""


TILES: dict[str, GroupedTiles] = {
    "rowwise": GroupedTiles(
        forward_input=lambda x: fp8_rowwise(x, -1),
        forward_weight=lambda w_t: fp8_rowwise(w_t, -2),
        grad_output=lambda g: fp8_rowwise(g, -1),
        grad_input_weight=lambda w_t: fp8_rowwise(w_t, -1),
        weight_grad_operand=fp8_per_group_columns,
    ),
    "mxfp8": GroupedTiles(
        forward_input=lambda x: mx_blocks(x, -1),
        forward_weight=lambda w_t: mx_blocks(w_t, -2),
        grad_output=lambda g: mx_blocks(g, -1),
        grad_input_weight=lambda w_t: mx_blocks(w_t, -1),
        # Groups are padded to 32 rows, so blocks of 32 tokens never straddle two experts.
        weight_grad_operand=lambda t, _group, _num_groups: mx_blocks(t, 0),
    ),
}


def blockwise_tiles(power_of_2: bool) -> GroupedTiles:
    """DeepSeek-V3's blockwise tiles per expert (blockwise_fp8.py), ``power_of_2`` rounding the scales down."""

    def weight_blocks(w_t: torch.Tensor) -> torch.Tensor:
        # Every expert's K is a multiple of 128, so the 128x128 blocks of the stacked [E * K, N] never straddle
        # two experts; a square block is the same block transposed, so [K, N] gives the blocks of [N, K].
        e, k, n = w_t.shape
        return fake_128x128(w_t.reshape(e * k, n), power_of_2=power_of_2).reshape(e, k, n)

    def token_tiles(t: torch.Tensor, _group: torch.Tensor, _num_groups: int) -> torch.Tensor:
        # Groups are padded to 128 rows, so no tile of 128 tokens straddles two experts.
        return fake_1x128(t.t(), power_of_2=power_of_2).t()

    return GroupedTiles(forward_input=lambda x: fake_1x128(x, power_of_2=power_of_2), forward_weight=weight_blocks,
                        grad_output=lambda g: fake_1x128(g, power_of_2=power_of_2), grad_input_weight=weight_blocks,
                        weight_grad_operand=token_tiles, float32_gemm=not power_of_2)


BLOCKWISE_TILES = {power_of_2: blockwise_tiles(power_of_2) for power_of_2 in (False, True)}
"""Built once: every grouped GEMM call looks its tiles up."""


def grouped_tiles(recipe: str, power_of_2: bool = False) -> GroupedTiles:
    """The tiles of ``recipe``; ``power_of_2`` applies to blockwise (the others' scales are powers of 2 anyway)."""
    return BLOCKWISE_TILES[power_of_2] if recipe == "blockwise" else TILES[recipe]


# --------------------------------------------------------------------------------------------------
# The GEMMs


class EmulatedGroupedMM(torch.autograd.Function):
    """The three grouped GEMMs on quantized-then-dequantized tiles, multiplied in ``x``'s dtype (in float32 where
    the tiles ask, ``float32_gemm``) and written in it. ``x`` is in the padded layout (every group a multiple of
    the recipe's alignment)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor, recipe: str,
                power_of_2: bool = False) -> torch.Tensor:
        tiles = grouped_tiles(recipe, power_of_2)
        ctx.save_for_backward(x, w_t, offsets)
        ctx.recipe, ctx.power_of_2 = recipe, power_of_2
        gemm = torch.float32 if tiles.float32_gemm else x.dtype
        out = torch._grouped_mm(tiles.forward_input(x).to(gemm), tiles.forward_weight(w_t).to(gemm), offs=offsets)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        x, w_t, offsets = ctx.saved_tensors
        tiles = grouped_tiles(ctx.recipe, ctx.power_of_2)
        gemm = torch.float32 if tiles.float32_gemm else x.dtype
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(tiles.grad_output(grad).to(gemm),
                                   tiles.grad_input_weight(w_t).to(gemm).transpose(-2, -1), offs=offsets)
        group = group_of_rows(offsets, x.shape[0])
        num_groups = offsets.numel()
        g_w = tiles.weight_grad_operand(grad, group, num_groups).to(gemm)
        x_w = tiles.weight_grad_operand(x, group, num_groups).to(gemm)
        grad_w = torch._grouped_mm(g_w.t(), x_w, offs=offsets)  # [E, N, K]
        return grad_x.to(x.dtype), grad_w.transpose(-2, -1).to(w_t.dtype), None, None, None


@torch.compiler.disable
def _eager_emulated_grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor, recipe: str,
                               power_of_2: bool) -> torch.Tensor:
    """``EmulatedGroupedMM`` kept out of compiled graphs: torch._grouped_mm's traced form takes bfloat16 only,
    so its float32 GEMMs (``float32_gemm``) would fail inside the compiler."""
    return EmulatedGroupedMM.apply(x, w_t, offsets, recipe, power_of_2)


def native_grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor, recipe: str) -> torch.Tensor:
    """torchao's kernels on padded ``x`` (bfloat16 in and out)."""
    if recipe == "blockwise":
        return native_blockwise_grouped_mm(x, w_t, offsets)
    if recipe == "rowwise":
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w_t, offsets, out_dtype=torch.bfloat16,
                                                      pad_token_groups_for_grouped_mm=False)
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return _to_mxfp8_then_scaled_grouped_mm(x, w_t, offsets, out_dtype=torch.bfloat16,
                                            kernel_preference=KernelPreference.AUTO,
                                            scale_calculation_mode=ScaleCalculationMode.RCEIL,
                                            pad_token_groups_for_grouped_mm=False)


def native_blockwise_grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor, *,
                                torchao_emulated: bool = False) -> torch.Tensor:
    """torchao's grouped blockwise GEMM on padded ``x``: DeepGEMM where torchao's own check passes (the converter
    chose this path only there), float32 scales 448 / amax. Groups are already padded to 128 rows.
    ``torchao_emulated``: torchao's emulated backend instead (any CUDA GPU with triton; the GPU tests compare it)."""
    from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if w_t.stride(-2) != 1:  # torchao asserts per-expert column-major (the experts pass w.transpose(-2, -1))
        w_t = w_t.transpose(-2, -1).contiguous().transpose(-2, -1)
    return _to_fp8_blockwise_then_scaled_grouped_mm(x, w_t, offsets, out_dtype=torch.bfloat16, block_size=BLOCK,
                                                    pad_token_groups_for_grouped_mm=False,
                                                    kernel_preference=KernelPreference.EMULATED
                                                    if torchao_emulated else KernelPreference.AUTO)


def quantized_grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor, *, recipe: str,
                         emulate: bool, power_of_2: bool = False) -> torch.Tensor:
    """x [M, K] @ w_t [E, K, N] per token group in ``recipe``, with the groups padded to its alignment and the
    padding removed from the result. Operands are taken in the compute dtype (the caller casts). ``power_of_2``:
    blockwise scales rounded down to powers of 2."""
    if power_of_2 and not emulate:
        raise ValueError("torchao's blockwise kernels compute float32 scales, never powers of 2: power_of_2 needs "
                         "emulate=True")
    layout = pad_groups(offsets, x.shape[0], GROUP_ALIGNMENT[recipe])
    padded = pad_rows(x, layout)
    if emulate and grouped_tiles(recipe, power_of_2).float32_gemm:
        out = _eager_emulated_grouped_mm(padded, w_t, layout.offsets, recipe, power_of_2)
    elif emulate:
        out = EmulatedGroupedMM.apply(padded, w_t, layout.offsets, recipe, power_of_2)
    else:
        out = native_grouped_mm(padded, w_t, layout.offsets, recipe)
    return unpad_rows(out, layout)


@dataclass(frozen=True)
class QuantizedGroupedMM:
    """The ``grouped_mm`` a converter installs on an experts module: the compute-dtype cast of the original
    method, then ``quantized_grouped_mm``. ``observer`` (set only while FP8 statistics are captured) sees every
    call's operands and output."""

    recipe: str
    emulate: bool
    observer: list[Callable[..., None]]
    """Called as ``observe(w, x, w_t, offsets, out)``: the weight as passed in, then the GEMM's operands in the
    compute dtype and its output."""
    power_of_2: bool = False
    """Blockwise scales rounded down to powers of 2."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # Autocast does not cover these GEMMs: cast as the high-precision grouped_mm does (FSDP's mixed
        # precision has already cast the weights).
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        x_c, w_c = x.to(dtype), w.to(dtype)
        out = quantized_grouped_mm(x_c, w_c, offsets, recipe=self.recipe, emulate=self.emulate,
                                   power_of_2=self.power_of_2)
        for observe in self.observer:
            observe(w, x_c, w_c, offsets, out)
        return out
