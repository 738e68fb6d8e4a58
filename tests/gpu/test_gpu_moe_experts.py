"""MoE grouped experts on CUDA: the bf16 grouped GEMM against the per-expert loop, and torchao's FP8 rowwise
(Hopper) / MXFP8 (Blackwell) grouped GEMM kernels against the emulation the CPU runs, forward and both backward
GEMMs, with empty and odd-sized token groups; the blockwise emulation on CUDA against the CPU (torchao's
blockwise kernel path: test_gpu_blockwise_experts.py)."""
from __future__ import annotations

import pytest
import torch
from _gpu_helpers import gpu_count, rel_err

from models.common.moe.experts import GroupedExperts
from torchtitan_lite.components.quantization.grouped_gemm import quantized_grouped_mm
from torchtitan_lite.components.quantization.moe_experts import (
    MIN_CAPABILITY,
    GroupedExpertsConverter,
    native_kernels_built,
)
from torchtitan_lite.protocols.model_converter import ConversionContext

pytestmark = pytest.mark.gpu

# Native and emulated GEMMs quantize the same tiles with the same scales; they differ in the accumulation
# (tensor cores, fast accumulation in the forward) and where bf16 rounds. That is well under 1% of the norm;
# a wrong scale, tile layout, padding or transpose is O(1).
GEMM_TOL = 0.02
COUNTS = [37, 0, 1, 130, 64, 17, 0, 263]  # empty, odd, aligned and long token groups
DIM, HIDDEN = 512, 256


def _has(recipe: str) -> bool:
    return (gpu_count() > 0 and torch.cuda.get_device_capability() >= MIN_CAPABILITY[recipe]
            and native_kernels_built(recipe))


def _operands():
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = sum(COUNTS)
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(len(COUNTS), HIDDEN, DIM, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    grad = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    offsets = torch.cumsum(torch.tensor(COUNTS, device="cuda"), 0).to(torch.int32)
    return x, w, grad, offsets


def _run(recipe: str, emulate: bool):
    x, w, grad, offsets = _operands()
    x, w = x.requires_grad_(), w.requires_grad_()
    out = quantized_grouped_mm(x, w.transpose(-2, -1), offsets, recipe=recipe, emulate=emulate)
    out.backward(grad)
    return out, x.grad, w.grad


@pytest.mark.parametrize("recipe", [
    pytest.param("rowwise", marks=pytest.mark.skipif(gpu_count() > 0 and not _has("rowwise"),
                                                     reason="needs torchao's FP8 grouped GEMM (sm_90+, triton)")),
    pytest.param("mxfp8", marks=pytest.mark.skipif(gpu_count() > 0 and not _has("mxfp8"),
                                                   reason="needs torchao's MXFP8 grouped GEMM kernels (sm_100+)")),
])
def test_native_grouped_gemms_match_the_emulation(recipe):
    native, emulated = _run(recipe, emulate=False), _run(recipe, emulate=True)
    for name, a, b in zip(("output", "input gradient", "weight gradient"), native, emulated):
        assert a.dtype == b.dtype == torch.bfloat16
        assert rel_err(a, b) < GEMM_TOL, name


def test_bf16_grouped_experts_match_the_per_expert_loop():
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, len(COUNTS)).cuda().bfloat16()
    experts.init_weights(0.02)
    x = torch.randn(sum(COUNTS), DIM, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor(COUNTS, device="cuda")
    # Both in bf16 with float32 accumulation: they differ by bf16 rounding of the SwiGLU intermediates.
    assert rel_err(experts.grouped_forward(x, counts), experts.loop_forward(x, counts)) < 0.01


def test_converter_picks_the_kernels_this_gpu_has():
    context = ConversionContext(device_type="cuda", param_dtype=torch.bfloat16, autocast=True, fsdp_sharded=False,
                                tp_enabled=False, compile_model=False, seq_len=128, output_module="output", blocks="layers")
    for recipe in ("rowwise", "mxfp8"):
        converter = GroupedExpertsConverter.Config(recipe_name=recipe).build(context=context)
        assert converter.kernel.emulate is (not _has(recipe)), converter.kernel.why


@pytest.mark.parametrize("power_of_2", [False, True])
def test_blockwise_emulation_on_the_gpu_matches_the_cpu(power_of_2):
    # Blockwise has no kernel: CUDA runs the same emulation, its float32 grouped GEMMs on torch's per-expert fallback.
    # Same tiles and scales; only the float32 summation order differs before the bf16 rounding of the results,
    # which moves an element by at most one bf16 step (2^-8 relative): 1e-3 of the norm leaves room for that and
    # none for a wrong tile, scale or padding.
    results = []
    for device in ("cuda", "cpu"):
        x, w, grad, offsets = (t.to(device) for t in _operands())
        x, w = x.requires_grad_(), w.requires_grad_()
        out = quantized_grouped_mm(x, w.transpose(-2, -1), offsets, recipe="blockwise", emulate=True,
                                   power_of_2=power_of_2)
        out.backward(grad)
        results.append((out, x.grad, w.grad))
    for name, a, b in zip(("output", "input gradient", "weight gradient"), *results):
        assert a.dtype == b.dtype == torch.bfloat16
        assert rel_err(a.cpu(), b) < 1e-3, name
