"""Blockwise FP8 routed experts on CUDA: torchao 0.18's grouped blockwise GEMM (``_to_fp8_blockwise_then_scaled_grouped_mm``)
against our emulation (float32 scales), forward output, input gradient and weight gradient, with an empty group and
uneven ones: (a) torchao's emulated backend (its Triton quantizers; any CUDA GPU), (b) its DeepGEMM backend (needs the
deep_gemm package), (c) the experts module through the converter with kernel='auto' on sm_90+."""
from __future__ import annotations

import copy

import pytest
import torch
from _gpu_helpers import gpu_count, rel_err
from torch import nn

from models.common.moe.experts import GroupedExperts
from torchtitan_lite.components.quantization.blockwise_grouped_kernel import NEED, deep_gemm_missing
from torchtitan_lite.components.quantization.grouped_gemm import (
    native_blockwise_grouped_mm,
    pad_groups,
    pad_rows,
    quantized_grouped_mm,
    unpad_rows,
)
from torchtitan_lite.components.quantization.moe_experts import GroupedExpertsConverter
from torchtitan_lite.protocols.model_converter import ConversionContext

pytestmark = pytest.mark.gpu

# Both quantize the same tiles with the same float32 scales (tests/unit/test_blockwise_grouped_tiles.py: bit for
# bit). torchao's emulated backend then rounds each dequantized operand to bfloat16 (e4m3 * bf16(1 / scale), about
# 2^-8 relative) where ours multiplies in float32: on the CPU, these operands through torchao's reference quantizers
# and that bfloat16 arithmetic differ from ours by 3.6e-3 (output, input gradient) and 3.8e-3 (weight gradient) of
# the norm. A wrong tile orientation, scale, padding or transpose re-rounds the e4m3 data: 2-3% or more.
GEMM_TOL = 0.01
COUNTS = [37, 0, 1, 130, 64, 17, 0, 263]  # empty, odd, aligned and long token groups
DIM, HIDDEN = 512, 256


def _hopper() -> bool:
    return gpu_count() > 0 and torch.cuda.get_device_capability() >= NEED


def _deep_gemm() -> bool:
    return _hopper() and not deep_gemm_missing()


def _operands():
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = sum(COUNTS)
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(len(COUNTS), HIDDEN, DIM, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    grad = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    offsets = torch.cumsum(torch.tensor(COUNTS, device="cuda"), 0).to(torch.int32)
    return x.requires_grad_(), w.requires_grad_(), grad, offsets


def _ours():
    x, w, grad, offsets = _operands()
    out = quantized_grouped_mm(x, w.transpose(-2, -1), offsets, recipe="blockwise", emulate=True)
    out.backward(grad)
    return out, x.grad, w.grad


def _torchao(torchao_emulated: bool):
    # Padded as our caller pads (groups of 128 rows, zeros between), then torchao's op.
    x, w, grad, offsets = _operands()
    layout = pad_groups(offsets, x.shape[0], 128)
    out = unpad_rows(native_blockwise_grouped_mm(pad_rows(x, layout), w.transpose(-2, -1), layout.offsets,
                                                 torchao_emulated=torchao_emulated), layout)
    out.backward(grad)
    return out, x.grad, w.grad


def _compare(torchao, ours) -> None:
    for name, a, b in zip(("output", "input gradient", "weight gradient"), torchao, ours):
        assert a.dtype == b.dtype == torch.bfloat16, name
        assert a.shape == b.shape, name
        err = rel_err(a, b)
        print(f"{name}: torchao vs ours {err:.2e} of the norm")
        assert err < GEMM_TOL, (name, err)


def test_torchaos_emulated_blockwise_grouped_gemm_matches_ours():
    _compare(_torchao(torchao_emulated=True), _ours())


@pytest.mark.skipif(gpu_count() > 0 and not _deep_gemm(),
                    reason="needs the deep_gemm package (DeepGEMM, with its M- and K-grouped FP8 GEMMs) on sm_90+")
def test_torchaos_deepgemm_blockwise_grouped_gemm_matches_ours():
    from torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels import can_use_deepgemm_grouped_training

    assert can_use_deepgemm_grouped_training(torch.empty(1, device="cuda"), torch.bfloat16, 128)
    _compare(_torchao(torchao_emulated=False), _ours())


@pytest.mark.skipif(gpu_count() > 0 and not _hopper(), reason="needs compute capability 9.0+ (Hopper)")
def test_converted_experts_with_kernel_auto_match_the_emulation():
    context = ConversionContext(device_type="cuda", param_dtype=torch.bfloat16, autocast=False, fsdp_sharded=False,
                                tp_enabled=False, compile_model=False, seq_len=128, output_module="output",
                                blocks="layers")
    torch.manual_seed(0)
    reference = nn.Sequential(GroupedExperts(DIM, HIDDEN, len(COUNTS))).cuda().bfloat16()
    reference[0].init_weights(0.02)
    results = []
    for kernel in ("auto", "emulated"):
        model = copy.deepcopy(reference)
        converter = GroupedExpertsConverter.Config(recipe_name="blockwise", kernel=kernel).build(context=context)
        if kernel == "auto":  # DeepGEMM where deep_gemm is usable, else emulated with that reason
            assert converter.kernel.emulate is (not _deep_gemm()), converter.kernel.why
            if not _deep_gemm():
                assert deep_gemm_missing() in converter.kernel.why
        converter.convert(model)
        assert "grouped_mm" in vars(model[0])
        x = torch.randn(sum(COUNTS), DIM, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(1)).requires_grad_()
        out = model[0](x, torch.tensor(COUNTS, device="cuda"))
        out.float().square().mean().backward()
        results.append((out, x.grad, *(p.grad for p in model.parameters())))
    # Without deep_gemm both run the emulation: equal. With it, SwiGLU chains three GEMMs: twice the GEMM tolerance.
    tol = 2 * GEMM_TOL if _deep_gemm() else 0.0
    for a, b in zip(*results):
        err = rel_err(a, b)
        print(f"kernel='auto' vs 'emulated': {err:.2e} of the norm")
        assert err <= tol
