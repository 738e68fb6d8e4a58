"""The mx converter: the kernel decision per device (fake GPU capabilities), its cross-section rules, the
plan and the swap, the MX Linear's numerics under autocast and FSDP-style casts, compile, and the
converter kinds that cannot be combined or are refused."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn as nn
from _conversion import context

from models.llama3.model import Llama3ModelArgs, Transformer
from torchtitan_lite.compat import inductor_cpu_mx_cast_error
from torchtitan_lite.components.quantization import Float8LinearConverter, MXLinearConverter
from torchtitan_lite.components.quantization.float8_plan import float8_plan
from torchtitan_lite.components.quantization.mx import decide_mx_kernel
from torchtitan_lite.components.quantization.mx_linear import MXLinear
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer

TINY = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)


# --------------------------------------------------------------------------------------------------
# Kernel decision


@pytest.mark.parametrize("kernel, device_type, capability, emulate, why", [
    ("auto", "cpu", None, True, "cpu has no MX tensor cores (they need compute capability 10.0+, Blackwell)"),
    ("emulated", "cpu", None, True, "MX GEMMs emulated, as kernel='emulated' asks"),
    ("auto", "cuda", (9, 0), True, "H100 (compute capability 9.0) has no MX tensor cores"),
    ("auto", "cuda", (8, 9), True, "set kernel='native' to make this an error instead"),
    ("auto", "cuda", (10, 0), False, "real MX kernels: H100 (compute capability 10.0) has MX tensor cores"),
    ("native", "cuda", (12, 0), False, "has MX tensor cores"),
    ("emulated", "cuda", (10, 0), True, "MX GEMMs emulated, as kernel='emulated' asks"),
    ("auto", "cuda", None, None, "decided on the GPU at launch"),
    ("native", "cuda", None, None, "else an error"),
])
def test_kernel_decision(kernel, device_type, capability, emulate, why):
    decision = decide_mx_kernel(kernel, device_type, capability, "H100")
    assert decision.emulate is emulate
    assert why in decision.why


@pytest.mark.parametrize("device_type, capability, message", [
    ("cpu", None, r"kernel='native' needs an NVIDIA GPU with MX tensor cores .* this run computes on cpu. Use "
                  r"kernel='auto'"),
    ("cuda", (9, 0), r"kernel='native': H100 \(compute capability 9.0\) has no MX tensor cores \(needs 10.0\+, "
                     r"Blackwell\). Use kernel='auto'"),
])
def test_native_kernel_without_mx_tensor_cores_is_an_error(device_type, capability, message):
    with pytest.raises(ValueError, match=message):
        decide_mx_kernel("native", device_type, capability, "H100")


def _fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")


def test_converter_emulates_below_sm100_and_logs_why(monkeypatch, caplog):
    _fake_gpu(monkeypatch, (9, 0))
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        converter = MXLinearConverter.Config().build(context=context(device_type="cuda"))
    assert converter.kernel.emulate is True
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0) has no MX tensor cores" in caplog.text
    with pytest.raises(ValueError, match="kernel='native'"):
        MXLinearConverter.Config(kernel="native").build(context=context(device_type="cuda"))


def test_converter_uses_real_kernels_on_blackwell(monkeypatch):
    _fake_gpu(monkeypatch, (10, 0))
    converter = MXLinearConverter.Config(kernel="native").build(context=context(device_type="cuda"))
    assert converter.kernel.emulate is False
    model = _meta_llama()
    converter.convert(model)
    assert model.layers["0"].attention.wq.kernel_preference.name == "AUTO"


# --------------------------------------------------------------------------------------------------
# Cross-section rules and config values


def test_float16_is_an_error():
    with pytest.raises(ValueError, match="precision.param_dtype=float16: torchao 0.18 has no float16 MX path"):
        MXLinearConverter.Config().build(context=context("float16"))


@pytest.mark.parametrize("kernel", ["native", "auto"])
def test_real_kernels_in_float32_are_an_error(monkeypatch, kernel):
    _fake_gpu(monkeypatch, (10, 0))
    with pytest.raises(ValueError, match=f"kernel='{kernel}' runs the real MX kernels here, and with "
                                         f"precision.param_dtype=float32 that cannot work: the MX GEMM writes bfloat16"):
        MXLinearConverter.Config(kernel=kernel).build(context=context("float32", device_type="cuda"))
    emulated = MXLinearConverter.Config(kernel="emulated").build(context=context("float32", device_type="cuda"))
    assert emulated.kernel.emulate


def test_seq_len_must_be_a_multiple_of_the_block_for_an_mx_weight_gradient():
    with pytest.raises(ValueError, match=r"training.seq_len=48 must be a multiple of 32.*Use training.seq_len=32, "
                                         r"or recipe_name='mxfp8_wgrad_with_hp'"):
        MXLinearConverter.Config().build(context=context(seq_len=48, compile_model=False))
    MXLinearConverter.Config(recipe_name="mxfp8_wgrad_with_hp").build(context=context(seq_len=48, compile_model=False))


@pytest.mark.parametrize("fields, message", [
    ({"recipe_name": "mxfp4"}, "recipe_name='mxfp4' is not one of: mxfp8, mxfp8_wgrad_with_hp"),
    ({"kernel": "cublas"}, "kernel='cublas' is not one of: auto, native, emulated"),
    ({"filter_fqns": [""]}, "filter_fqns entry '' would match every module"),
    ({"keep_first_blocks_hp": -1}, "keep_first_blocks_hp=-1 must be a non-negative integer"),
])
def test_bad_values_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        MXLinearConverter.Config(**fields)


def test_float8_and_mx_cannot_be_combined():
    with pytest.raises(ValueError, match=r"converters\[0\] \(float8\) and \[1\] \(mx\) both convert nn.Linear modules"):
        ModelConvertersContainer.Config(converters=[Float8LinearConverter.Config(), MXLinearConverter.Config()])




# --------------------------------------------------------------------------------------------------
# Plan and conversion


def _meta_llama() -> Transformer:
    with torch.device("meta"):
        return Transformer(TINY)


def test_plan_skips_dims_not_divisible_by_the_block_and_keeps_the_edges():
    model = _meta_llama()
    with torch.device("meta"):
        model.layers["1"].feed_forward.w2 = nn.Linear(48, 64, bias=False)
    converter = MXLinearConverter.Config(keep_first_blocks_hp=1).build(context=context(compile_model=False))
    reasons = {row.fqn: (row.recipe, row.reason)
               for row in float8_plan(model, converter.config, output_module="output", blocks="layers")}
    assert reasons["layers.0.attention.wq"] == (None, "block 0 of the first 1 (keep_first_blocks_hp)")
    assert reasons["layers.1.attention.wq"] == ("mxfp8", "")
    assert reasons["layers.1.feed_forward.w2"] == (None, "dims not divisible by 32 (MX block)")
    assert reasons["output"] == (None, "output projection (keep_output_hp)")
    text = converter.explain(model)
    assert text.splitlines()[0].startswith("mx converter (recipe mxfp8, 32-element blocks with e8m0 scales; MX GEMMs "
                                           "emulated: cpu has no MX tensor cores")
    assert text.splitlines()[1] == "FP8 plan: 6 of 15 Linear layers run in FP8"


def test_conversion_swaps_the_planned_linears_and_keeps_their_parameters():
    model = _meta_llama()
    before = {name: p for name, p in model.named_parameters()}
    config = MXLinearConverter.Config(recipe_name="mxfp8_wgrad_with_hp", keep_output_hp=False)
    asdict = dataclasses.asdict(config)
    converter = config.build(context=context(compile_model=False))
    converter.convert(model)
    swapped = {fqn for fqn, m in model.named_modules() if isinstance(m, MXLinear)}
    assert swapped == {row.fqn for row in converter.plan if row.recipe} and "output" in swapped
    assert len(swapped) == 2 * 7 + 1
    assert all(m.wgrad_with_hp and m.kernel_preference.name == "EMULATED"
               for m in model.modules() if isinstance(m, MXLinear))
    # The same Parameter objects: optimizer, checkpoint keys and weight ties are untouched.
    assert {name: p for name, p in model.named_parameters()} == before
    assert dataclasses.asdict(config) == asdict


# --------------------------------------------------------------------------------------------------
# Numerics


def _pair(seed: int = 0) -> tuple[nn.Linear, MXLinear]:
    torch.manual_seed(seed)
    linear = nn.Linear(64, 96, bias=True)
    converter = MXLinearConverter.Config().build(context=context(compile_model=False))
    mx = converter.mx_linear(nn.Linear(64, 96, bias=True))
    mx.load_state_dict(linear.state_dict())
    return linear, mx


def test_autocast_and_fsdp_style_casts_quantize_the_same_bfloat16_values():
    _, mx = _pair()
    x = torch.randn(4, 32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_out = mx(x)
    fsdp_style = _pair()[1].to(torch.bfloat16)
    assert autocast_out.dtype == torch.bfloat16
    assert torch.equal(autocast_out, fsdp_style(x.to(torch.bfloat16)))


def test_mx_output_is_close_to_high_precision_but_not_equal():
    linear, mx = _pair()
    x = torch.randn(4, 32, 64)
    with torch.no_grad():
        ref, out = linear(x), mx(x)
    # e4m3 keeps 3 mantissa bits: ~3.6% RMS error per operand, ~5% on the output (28.5 dB measured by
    # fp8_sqnr); 2% / 10% brackets it and shows both that MX ran and that it is not broken.
    rel = float((out - ref).norm() / ref.norm())
    assert 0.02 < rel < 0.10, rel


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_mx_block_matches_eager(backend):
    # aot_eager: dynamo traces the MX autograd function and the MX tensor subclass into the graphs inductor
    # gets, without code generation; inductor (the trainer's backend, ~20 s on CPU) fuses them. Between the
    # MX GEMMs sits a ReLU, exact in any precision: then both match eager bit for bit (measured), so the
    # comparison is exact. (A SiLU, whose backward inductor fuses in float32 where eager rounds each op to
    # bfloat16, moves some gradient elements across e4m3 rounding steps: 1.2% relative, measured.)
    def grads(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64, bias=False))
        converter = MXLinearConverter.Config().build(context=context(compile_model=False))  # compiled here
        for i in (0, 2):
            block[i] = converter.mx_linear(block[i])
        block = block.to(torch.bfloat16)
        run = torch.compile(block, backend=backend) if compiled else block
        x = torch.randn(2, 32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        out = run(x)
        out.float().square().sum().backward()
        return out.detach(), block[0].weight.grad

    if backend == "inductor" and inductor_cpu_mx_cast_error() is not None:
        # torch 2.11's inductor fuses the e8m0 reinterpretation of the MX scales into a C++ kernel it cannot
        # write (torchtitan_lite/compat.py): the converter refuses MX compiled for CPU there, naming torch 2.13.
        refusal = r"converters\[mx\] with compile\.enable=true on CPU needs torch 2\.13: .*DTYPE_TO_CPP.*compile\.enable=false"
        with pytest.raises(ValueError, match=refusal):
            MXLinearConverter.Config().build(context=context(compile_model=True))
        return
    eager, compiled = grads(False), grads(True)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_inductor_compiles_the_mx_cast_like_eager_or_the_converter_refuses():
    # The default suite's cover of test_compiled_mx_block_matches_eager[inductor] (slow: a whole block's forward
    # and backward through inductor): the MX cast alone (to MXFP8 and back, the graph inductor could not write on
    # torch 2.11) compiled by inductor gives eager's values bit for bit, and the converter then accepts
    # compile.enable=true on CPU; where it cannot be compiled the converter refuses.
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    if inductor_cpu_mx_cast_error() is not None:
        with pytest.raises(ValueError, match=r"compile\.enable=true on CPU needs torch 2\.13"):
            MXLinearConverter.Config().build(context=context(compile_model=True))
        return
    MXLinearConverter.Config().build(context=context(compile_model=True))

    def cast(x: torch.Tensor) -> torch.Tensor:
        scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        return data.to(torch.bfloat16).reshape(-1, 32) * get_fp_scale(scale).reshape(-1, 1).to(torch.bfloat16)

    x = torch.randn(8, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3)) * 10
    eager, compiled = cast(x), torch.compile(cast, backend="inductor", fullgraph=True)(x)
    assert not torch.equal(eager, x.reshape(-1, 32))  # the cast rounds: a pass-through could not match by accident
    assert torch.equal(eager, compiled)
