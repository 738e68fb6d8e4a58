"""The blockwise grouped experts quantize exactly as torchao 0.18's grouped blockwise GEMM does: each of our tiles
(grouped_gemm.blockwise_tiles, float32 scales) against torchao's pure-torch reference quantizers, which its Triton
kernels are tested against upstream.

torchao (``prototype/blockwise_fp8_training/kernels.py``): scale ``s = float32(448 / float64(max(amax, 1e-12)))``
(never a power of 2), data ``e4m3(clamp(x * s, -448, 448))``, and it keeps ``1 / s`` for the GEMM. The tiles:
forward ``x`` 1x128 along K (``act_quant_lhs``) and each expert's weight in 128x128 blocks (``weight_quant`` of
``w_t[e]ᵀ``); input gradient ``g`` 1x128 along N (``act_quant_lhs``) and the same blocks; weight gradient ``gᵀ``
1x128 along the tokens (``act_quant_transposed_lhs`` = ``act_quant_lhs`` of ``gᵀ``) and ``x`` in 128x1 tiles along
the tokens (``act_quant_rhs``).

Tolerance: the e4m3 data and the reciprocal scales are equal bit for bit; our dequantized tile is ``q / s`` and
torchao's ``q * (1 / s)``, two float32 roundings apart at most (relative 2^-22)."""
from __future__ import annotations

import pytest
import torch
from _torchao_blockwise_reference import load

from torchtitan_lite.components.quantization.blockwise_fp8 import quantize_1x128, quantize_128x128
from torchtitan_lite.components.quantization.grouped_gemm import grouped_tiles

REF = load()
TILES = grouped_tiles("blockwise", power_of_2=False)
FLOAT32_ROUNDINGS = 2 * 2.0**-23


def _operand(rows: int, cols: int, seed: int) -> torch.Tensor:
    # Tile magnitudes from 1e-4 to 1e3 (scales far from powers of 2), one all-zero tile (the EPS floor), bf16.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 3, cols).roll(seed)
    x[:128, 128:256] = 0
    return x.bfloat16()


def _dequantized(q: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    per_row = inverse.repeat_interleave(rows // inverse.shape[0], 0)
    return q.float() * per_row.repeat_interleave(cols // inverse.shape[1], 1)


def _assert_same_tiles(ours: torch.Tensor, q: torch.Tensor, inverse: torch.Tensor) -> None:
    torch.testing.assert_close(ours, _dequantized(q, inverse), rtol=FLOAT32_ROUNDINGS, atol=0)


@pytest.mark.parametrize("operand", ["forward_input", "grad_output"])
def test_activation_and_gradient_tiles_are_torchaos_1x128(operand):
    x = _operand(256, 512, seed=1)
    q, inverse = REF["torch_blockwise_scale_act_quant_lhs"](x.contiguous())
    data, scale = quantize_1x128(x, power_of_2=False)
    assert torch.equal(data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(1.0 / scale, inverse)
    _assert_same_tiles(getattr(TILES, operand)(x), q, inverse)


@pytest.mark.parametrize("operand", ["forward_weight", "grad_input_weight"])
def test_each_experts_weight_blocks_are_torchaos_128x128(operand):
    w = torch.stack([_operand(256, 384, seed=e) for e in range(3)])  # [E, N, K] as the experts store it
    w_t = w.transpose(-2, -1)
    ours = getattr(TILES, operand)(w_t)
    for e in range(w.shape[0]):
        # torchao quantizes w_t[e]ᵀ (contiguous [N, K]) per expert, for both GEMMs.
        q, inverse = REF["torch_blockwise_scale_weight_quant"](w_t[e].t().contiguous())
        data, scale = quantize_128x128(w[e], power_of_2=False)
        assert torch.equal(data.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(1.0 / scale, inverse)
        _assert_same_tiles(ours[e].t(), q, inverse)


def test_weight_gradient_tiles_are_torchaos_128_tokens():
    g, x = _operand(384, 256, seed=2), _operand(384, 512, seed=3)  # 384 tokens in 3 groups of 128
    group = torch.arange(384) // 128
    # gᵀ: torchao's act_quant_transposed_lhs, 1x128 tiles of gᵀ along the tokens.
    q, inverse = REF["torch_blockwise_scale_act_quant_lhs"](g.t().contiguous())
    _assert_same_tiles(TILES.weight_grad_operand(g, group, 3).t(), q, inverse)
    # x: torchao's act_quant_rhs, 128x1 tiles along the tokens.
    q, inverse = REF["torch_blockwise_scale_act_quant_rhs"](x.contiguous())
    assert inverse.shape == (3, 512)
    _assert_same_tiles(TILES.weight_grad_operand(x, group, 3), q, inverse)


def test_torchaos_scales_are_not_powers_of_2_so_power_of_2_tiles_differ():
    x = _operand(128, 512, seed=4)
    _, inverse = REF["torch_blockwise_scale_act_quant_lhs"](x.contiguous())
    mantissa, _ = torch.frexp(inverse)
    assert (mantissa != 0.5).float().mean() > 0.9  # float32 scales: almost none is a power of 2
    power_of_2 = grouped_tiles("blockwise", power_of_2=True).forward_input(x)
    assert not torch.equal(power_of_2, TILES.forward_input(x))
