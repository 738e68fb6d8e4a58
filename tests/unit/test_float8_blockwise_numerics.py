"""Blockwise FP8 numerics: the tiles and their scales exactly, the three emulated GEMMs against a hand
reference that quantizes the same tiles, and why fine-grained scales matter (SQNR with outlier rows)."""
from __future__ import annotations

import pytest
import torch

from torchtitan_lite.components.quantization.blockwise_fp8 import (
    dequantize_1x128,
    emulated_blockwise_linear,
    quantize_1x128,
    quantize_128x128,
    scaled_saturated,
    to_e4m3_saturated,
)

# --------------------------------------------------------------------------------------------------
# Tiles and scales


def test_1x128_tiles_have_one_scale_each_and_the_tile_amax_maps_to_448():
    x = torch.zeros(2, 256)
    x[0, :128] = torch.linspace(-3.0, 1.0, 128)   # amax 3
    x[0, 128:] = 0.5                                # amax 0.5
    x[1, 5] = -7.0                                  # amax 7, the rest zero
    data, scale = quantize_1x128(x, power_of_2=False)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (2, 256)
    expected = torch.tensor([[448 / 3, 448 / 0.5], [448 / 7, 448 / 1e-12]], dtype=torch.float64).float()
    assert torch.equal(scale, expected)
    assert data[0, 0].item() == -448.0 and data[0, 128].item() == 448.0 and data[1, 5].item() == -448.0
    assert torch.equal(data[1, 128:].float(), torch.zeros(128))   # an all-zero tile stays zero, no NaN
    # Dequantized, each element is its own E4M3 rounding: relative error at most 2**-4 (3 mantissa bits).
    back = dequantize_1x128(data, scale)
    nonzero = x != 0
    assert ((back - x).abs()[nonzero] <= x.abs()[nonzero] * 2 ** -4).all()


def test_power_of_2_scales_round_448_over_amax_down():
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 128] = 3.0, 0.001
    _, scale = quantize_1x128(x, power_of_2=True)
    # 448/3 = 149.3 -> 128; 448/0.001 = 448000 -> 2**18 = 262144.
    assert scale.tolist() == [[128.0, 262144.0]]


def test_a_short_last_tile_has_its_own_scale():
    x = torch.ones(1, 130)
    x[0, 129] = 2.0
    data, scale = quantize_1x128(x, power_of_2=False)
    assert data.shape == (1, 130) and scale.tolist() == [[448.0, 224.0]]


def test_128x128_blocks_have_one_scale_each():
    w = torch.zeros(256, 384)
    w[0, 0] = 2.0          # block (0, 0)
    w[200, 300] = -4.0     # block (1, 2)
    w[130, 10] = 1.0       # block (1, 0)
    data, scale = quantize_128x128(w, power_of_2=False)
    assert scale.shape == (2, 3)
    assert scale[0, 0].item() == 224.0 and scale[1, 2].item() == 112.0 and scale[1, 0].item() == 448.0
    assert data[0, 0].item() == 448.0 and data[200, 300].item() == -448.0 and data[130, 10].item() == 448.0
    with pytest.raises(ValueError, match="128x128-block weight needs both dims multiples of 128, got 100 x 128"):
        quantize_128x128(torch.ones(100, 128), power_of_2=False)


def test_values_past_the_e4m3_range_saturate_to_448():
    # The clamp itself, before the cast: torch 2.12+ CPU casts saturate on their own, so the cast's result alone
    # would not show a missing clamp. 500 and -1e30 times the scale 2 lie past 448; 200 * 2 = 400 and
    # -223.5 * 2 = -447 lie within it and pass unchanged (not rounded yet).
    scaled = scaled_saturated(torch.tensor([500.0, -1e30, 200.0, -223.5]), torch.tensor(2.0))
    assert scaled.dtype == torch.float32 and scaled.tolist() == [448.0, -448.0, 400.0, -447.0]
    # The cast then rounds: 447 to 448 (e4m3's neighbours there are 416 and 448).
    data = to_e4m3_saturated(torch.tensor([1000.0, -1e30, 447.0]), torch.tensor(1.0))
    assert data.float().tolist() == [448.0, -448.0, 448.0]


# --------------------------------------------------------------------------------------------------
# The three GEMMs against a hand reference


def _ref_tiles(t: torch.Tensor, power_of_2: bool) -> torch.Tensor:
    """t (rows x cols) quantized tile by tile (1x128 along cols) in plain Python loops, in float64."""
    out = torch.empty(t.shape, dtype=torch.float64)
    for r in range(t.shape[0]):
        for c in range(0, t.shape[1], 128):
            tile = t[r, c:c + 128].double()
            scale = torch.tensor(448.0 / max(tile.abs().max().item(), 1e-12)).float()
            if power_of_2:
                scale = torch.tensor(2.0 ** torch.floor(torch.log2(scale)).item())
            q = (tile.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[r, c:c + 128] = q.double() / scale.double()
    return out


def _ref_blocks(w: torch.Tensor, power_of_2: bool) -> torch.Tensor:
    """w quantized block by block (128x128, one scale each), in float64."""
    out = torch.empty(w.shape, dtype=torch.float64)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            block = w[i:i + 128, j:j + 128]
            scale = torch.tensor(448.0 / max(block.abs().max().item(), 1e-12)).float()
            if power_of_2:
                scale = torch.tensor(2.0 ** torch.floor(torch.log2(scale)).item())
            q = (block.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[i:i + 128, j:j + 128] = q.double() / scale.double()
    return out


def _operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 128, 256, generator=g)          # M = 256 tokens, K = 256
    x[0, 3] *= 300.0                                    # an outlier token
    w = torch.randn(384, 256, generator=g) * 0.05      # N = 384
    w[7, :] *= 50.0                                     # an outlier output channel
    dy = torch.randn(2, 128, 384, generator=g)
    return x, w, dy


# Only the accumulation order differs: float32 sums of 256 to 384 products against a float64 reference of
# the same quantized tiles. Measured worst error relative to the result's largest magnitude: 3e-9 to 8.0e-7
# over the three GEMMs and both scale kinds; the weight gradient tiled along the features instead of the
# tokens (test_a_wrong_tiling_is_caught) misses by 7.6e-2.
RTOL = 2e-6


def _close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("power_of_2", [False, True])
def test_forward_and_both_gradients_equal_the_hand_reference(power_of_2):
    x, w, dy = _operands()
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = emulated_blockwise_linear(x, w, power_of_2=power_of_2)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 256), dy.reshape(-1, 384)
    ref_y = _ref_tiles(x2, power_of_2) @ _ref_blocks(w.detach(), power_of_2).t()
    ref_dx = _ref_tiles(dy2, power_of_2) @ _ref_blocks(w.detach(), power_of_2)
    ref_dw = _ref_tiles(dy2.t(), power_of_2) @ _ref_tiles(x2.t(), power_of_2).t()   # tiles along the tokens
    assert _close(y.reshape(-1, 384), ref_y) < RTOL
    assert _close(x.grad.reshape(-1, 256), ref_dx) < RTOL
    assert _close(w.grad, ref_dw) < RTOL


# The same comparison with a tolerance derived rather than measured, element by element, for any accumulation
# order: the emulation's dequantized operands are the reference's rounded once to float32 (exact with power-of-2
# scales: the division by the scale only moves the exponent), and a float32 dot product of K terms, summed in any
# order (blocked, FMA, the kernel's own), is within gamma(K) * sum |a_i b_i| of the exact one (Higham, Accuracy
# and Stability of Numerical Algorithms, eq. 3.5), gamma(n) = n u / (1 - n u), u = 2^-24. With both operand
# roundings: gamma(K + 2). A bfloat16 result adds its own rounding, u_bf16 = 2^-8 of the result.
U_FP32, U_BF16 = 2.0 ** -24, 2.0 ** -8


def _gamma(n: int) -> float:
    return n * U_FP32 / (1 - n * U_FP32)


def _within_bound(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """max over elements of |actual - a @ b| / bound, a and b the float64 reference tiles (< 1: within it)."""
    exact, magnitude = a @ b, a.abs() @ b.abs()
    bound = _gamma(a.shape[1] + 2) * magnitude
    if actual.dtype == torch.bfloat16:
        bound = U_BF16 * exact.abs() + (1 + U_BF16) * bound
    # Elements whose exact value and bound are both 0 (an all-zero row) must come out exactly 0.
    return ((actual.double() - exact).abs() / bound.clamp(min=1e-300)).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("power_of_2", [False, True], ids=["float32_scales", "pow2_scales"])
def test_every_gemm_is_within_the_float32_accumulation_bound_of_the_reference(power_of_2, dtype):
    """All three GEMMs, both scale kinds, float32 and bfloat16 compute, on a token count that is not a multiple of
    128 (200: the weight gradient's last tile along the tokens is 72 long). Measured worst ratio to the bound:
    0.002-0.09 in float32 (the weight gradient highest), 0.96-0.99 in bfloat16 (its own rounding, which the bound
    covers exactly); the weight gradient tiled along the features instead of the tokens exceeds it."""
    tokens = 200
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 256, generator=g)
    x[3] *= 300.0                                        # an outlier token
    w = torch.randn(384, 256, generator=g) * 0.05
    w[7] *= 50.0                                         # an outlier output channel
    dy = torch.randn(tokens, 384, generator=g)
    x, w, dy = x.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(True), dy.to(dtype)
    y = emulated_blockwise_linear(x, w, power_of_2=power_of_2)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    xd, wd, dyd = x.detach(), w.detach(), dy
    worst = {
        "forward": _within_bound(y, _ref_tiles(xd, power_of_2), _ref_blocks(wd, power_of_2).t()),
        "input gradient": _within_bound(x.grad, _ref_tiles(dyd, power_of_2), _ref_blocks(wd, power_of_2)),
        "weight gradient": _within_bound(w.grad, _ref_tiles(dyd.t(), power_of_2), _ref_tiles(xd.t(), power_of_2).t()),
    }
    assert all(ratio < 1.0 for ratio in worst.values()), worst


def test_a_wrong_tiling_is_caught():
    """Control: the weight gradient with its tiles along K / N (not the tokens) is far outside RTOL."""
    x, w, dy = _operands()
    w.requires_grad_(True)
    emulated_blockwise_linear(x, w, power_of_2=False).backward(dy)
    x2, dy2 = x.reshape(-1, 256), dy.reshape(-1, 384)
    along_features = _ref_tiles(dy2, False).t() @ _ref_tiles(x2, False)
    assert _close(w.grad, along_features) > 100 * RTOL


def test_bfloat16_operands_give_bfloat16_results_and_gradients():
    x, w, dy = _operands()
    x, w = x.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    y = emulated_blockwise_linear(x, w, power_of_2=True)
    y.backward(dy.bfloat16())
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# Why blockwise: outliers coarsen only their own tile


def _sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).mean() / (ref - approx).pow(2).mean())).item()


def _tensorwise(t: torch.Tensor) -> torch.Tensor:
    scale = 448.0 / t.abs().max()
    return to_e4m3_saturated(t, scale).float() / scale


def test_blockwise_beats_tensorwise_on_outlier_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=g)
    x[::64] *= 1e5                                       # 8 outlier tokens of 512
    w = torch.randn(512, 512, generator=g) * 0.02
    exact = x @ w.t()
    blockwise = emulated_blockwise_linear(x, w, power_of_2=False)
    tensorwise = _tensorwise(x) @ _tensorwise(w).t()
    normal_rows = torch.ones(512, dtype=torch.bool)
    normal_rows[::64] = False
    # Measured (seed 0), outputs of the 504 ordinary tokens against float32: blockwise 28.7 dB, tensorwise
    # 5.8 dB (next to the outliers their inputs fall to E4M3's subnormals). With outliers 1e3 (1e4) times
    # larger tensorwise gets 28.5 (24.7) dB and blockwise stays at 28.7: each token has its own scales.
    assert _sqnr(exact[normal_rows], blockwise[normal_rows]) > 27.0
    assert _sqnr(exact[normal_rows], tensorwise[normal_rows]) < 10.0
