"""Blockwise FP8 (DeepSeek-V3 tiles) on torchao's sm_90 kernels against the CPU-tested emulation, and the converter's
kernel decision on the GPU."""
from __future__ import annotations

import copy

import pytest
import torch
from _gpu_helpers import gpu_count, rel_err

from torchtitan_lite.components.quantization.blockwise_linear import BlockwiseFP8Linear, blockwise_linear_from
from torchtitan_lite.components.quantization.float8_blockwise import (
    NATIVE_CAPABILITY,
    Float8BlockwiseConverter,
    native_kernels_missing,
)
from torchtitan_lite.protocols.model_converter import ConversionContext


def _native_obstacle() -> str:
    """Why torchao's blockwise kernels cannot run on this machine's GPU, or ''."""
    if gpu_count() == 0:
        return ""   # tests/conftest.py skips every gpu test with "needs CUDA"
    capability = torch.cuda.get_device_capability()
    if capability != NATIVE_CAPABILITY:
        return f"needs an sm_90 GPU for torchao's blockwise kernels (found sm_{capability[0]}{capability[1]})"
    return native_kernels_missing()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_native_obstacle()), reason=_native_obstacle() or "-")]

# Both paths quantize the same tiles to the same E4M3 values: torchao's Triton kernels compute the scale as this
# project does (448 / amax in float64, rounded to float32, amax clamped at 1e-12) and saturate at +-448. They differ
# in the GEMM: torchao's scaled_mm multiplies by the reciprocal scales (one float32 rounding, 2^-24) and accumulates
# on the tensor cores (promoted to float32 every 128-element block along K, as DeepSeek-V3 prescribes), where the
# emulation sums the dequantized values in float32; both round the result to bfloat16 (2^-8 relative per element, at
# most one bfloat16 ulp apart). That is well under 0.5% relative (Frobenius) error. A wrong tile layout, scale or
# transpose costs O(1e-2) or more: the same emulation with power-of-2 scales (a different rounding of every tile)
# is the control that the tolerance separates.
NATIVE_TOL = 5e-3


def _pair(k: int, n: int, *, power_of_2: bool = False) -> tuple[BlockwiseFP8Linear, BlockwiseFP8Linear]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    native = blockwise_linear_from(copy.deepcopy(linear), emulate=False, power_of_2=False)
    emulated = blockwise_linear_from(copy.deepcopy(linear), emulate=True, power_of_2=power_of_2)
    return native, emulated


def _forward_backward(module: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad_out)
    return out, x.grad, module.weight.grad


# One shape: torchao's first call per shape autotunes six Triton kernels, ~100 s on an H200 (2026-11-27), which
# a second shape would double. 512 inputs are 4 tiles along K and 768 outputs 6 weight blocks: enough for a
# wrong tile order or transpose to show. This shape passed on an H200 (torch 2.11, torchao 0.18).
@pytest.mark.parametrize("tokens,k,n", [(1024, 512, 768)])
def test_native_blockwise_gemms_match_the_emulation(tokens, k, n):
    native, emulated = _pair(k, n)
    _, pow2 = _pair(k, n, power_of_2=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, tokens // 2, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    x[0, 3] *= 100.0   # an outlier token: its own tiles along K, shared tiles along the tokens (weight gradient)
    grad_out = torch.randn(2, tokens // 2, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out_n, dx_n, dw_n = _forward_backward(native, x, grad_out)
    out_e, dx_e, dw_e = _forward_backward(emulated, x, grad_out)
    out_p, dx_p, dw_p = _forward_backward(pow2, x, grad_out)
    assert out_n.dtype == dx_n.dtype == dw_n.dtype == torch.bfloat16
    errors = {"forward": rel_err(out_n, out_e), "input gradient": rel_err(dx_n, dx_e),
              "weight gradient": rel_err(dw_n, dw_e)}
    assert all(e < NATIVE_TOL for e in errors.values()), errors
    controls = {"forward": rel_err(out_n, out_p), "input gradient": rel_err(dx_n, dx_p),
                "weight gradient": rel_err(dw_n, dw_p)}
    assert all(c > NATIVE_TOL for c in controls.values()), controls


def test_auto_picks_torchaos_kernels_on_this_gpu():
    context = ConversionContext(device_type="cuda", param_dtype=torch.bfloat16, autocast=False, fsdp_sharded=True,
                                tp_enabled=False, compile_model=False, seq_len=256, output_module="output", blocks="layers")
    converter = Float8BlockwiseConverter.Config().build(context=context)
    assert converter.kernel.emulate is False
    assert converter.kernel.why.startswith("torchao's blockwise FP8 kernels on ")
    model = torch.nn.ModuleDict({"up": torch.nn.Linear(256, 512, bias=False), "output": torch.nn.Linear(512, 128)})
    converter.convert(model)
    assert isinstance(model["up"], BlockwiseFP8Linear) and model["up"].emulate is False
    assert type(model["output"]) is torch.nn.Linear   # the output projection stays high precision
