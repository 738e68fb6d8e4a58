"""Real FP8 GEMMs (torch._scaled_mm on FP8 tensor cores) against torchao's emulation, eager and compiled."""
from __future__ import annotations

import copy

import pytest
import torch
from _gpu_helpers import float8_converter, mlp, needs_fp8, rel_err

pytestmark = [pytest.mark.gpu, needs_fp8]

# Both paths quantize the same operands to the same float8 values (same amax, same scales); they differ
# only in the GEMM: emulation multiplies the dequantized values in float32, _scaled_mm accumulates on
# the tensor cores (fast accumulation in the forward) and both round the result to bfloat16 (2^-9
# relative). Those differences are well under 1%; a wrong scale, layout or transpose is O(1).
GEMM_TOL = 0.02


def _forward_backward(model, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad_out)
    return out, x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_scaled_mm_matches_emulation_forward_and_backward(recipe):
    real, emulated = mlp(), mlp()
    float8_converter(recipe).convert(real)
    float8_converter(recipe, emulate=True).convert(emulated)
    assert real[0].config.emulate is False and emulated[0].config.emulate is True
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    out_r, dx_r, dw_r = _forward_backward(real, x, grad_out)
    out_e, dx_e, dw_e = _forward_backward(emulated, x, grad_out)
    assert rel_err(out_r, out_e) < GEMM_TOL
    assert rel_err(dx_r, dx_e) < GEMM_TOL
    for real_grad, emulated_grad in zip(dw_r, dw_e):
        assert rel_err(real_grad, emulated_grad) < GEMM_TOL


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_float8_linear_matches_eager(recipe):
    eager = mlp()
    float8_converter(recipe).convert(eager)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    out_e, dx_e, dw_e = _forward_backward(eager, x, grad_out)
    out_c, dx_c, dw_c = _forward_backward(compiled, x, grad_out)
    # Inductor fuses the amax, scale and cast kernels; the float8 values may differ in the last bit where a
    # fused scale rounds differently, which moves results by far less than the GEMM tolerance.
    assert rel_err(out_c, out_e) < GEMM_TOL
    assert rel_err(dx_c, dx_e) < GEMM_TOL
    for compiled_grad, eager_grad in zip(dw_c, dw_e):
        assert rel_err(compiled_grad, eager_grad) < GEMM_TOL


def test_compiled_float8_llama_block_trains_close_to_bfloat16():
    from models.llama3 import Llama3ModelArgs
    from models.llama3.model import TransformerBlock

    args = Llama3ModelArgs(dim=512, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=1024, multiple_of=256,
                           max_seq_len=256)
    torch.manual_seed(0)
    block = TransformerBlock(0, args).to(device="cuda", dtype=torch.bfloat16)
    block.init_weights()
    reference = copy.deepcopy(block)
    container = torch.nn.ModuleDict({"block": block})
    converter = float8_converter("tensorwise")
    converter.convert(container)
    assert sum(type(m).__name__ == "Float8Linear" for m in block.modules()) == 7  # wq wk wv wo w1 w2 w3
    compiled = torch.compile(block)
    rope = _rope(args).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 256, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(2, 256, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    x_c, x_r = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_c, out_r = compiled(x_c, rope), reference(x_r, rope)
    out_c.backward(grad_out)
    out_r.backward(grad_out)
    # FP8 against BF16 (not emulation): e4m3 operands carry ~3.6% RMS rounding, e5m2 gradients ~6%, but the
    # residual stream carries x through unchanged, so the block is much closer than one Linear (eager FP8
    # tensorwise vs float32 on CPU, same shapes: 0.3% output, 0.6% input gradient); bf16 adds ~0.4%.
    assert rel_err(out_c, out_r) < 0.03
    assert rel_err(x_c.grad, x_r.grad) < 0.06


def _rope(args):
    """The rotary cache the model passes its blocks, built as the model builds it."""
    from models.common.attention.rope import rope_cache

    return rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
