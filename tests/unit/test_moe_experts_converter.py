"""The moe_experts converter: which expert GEMMs it converts (and that it really does), the plan with the router,
its kernel choice, its composition with the dense float8 / mx converters, and the FP8 statistics of the experts."""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import sys

import pytest
import torch
import torch.nn as nn
from _conversion import context

from models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeModel
from torchtitan_lite.components.quantization import (
    Float8BlockwiseConverter,
    Float8LinearConverter,
    GroupedExpertsConverter,
    MXLinearConverter,
)
from torchtitan_lite.components.quantization import moe_experts as moe_experts_module
from torchtitan_lite.components.quantization.float8_plan import float8_plan
from torchtitan_lite.components.quantization.fp8_stats import Fp8StatsCollector
from torchtitan_lite.components.quantization.grouped_gemm import QuantizedGroupedMM, quantized_grouped_mm
from torchtitan_lite.components.quantization.moe_experts import decide_grouped_kernel
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer

EXPERT_GEMMS = [f"layers.{i}.moe.experts.{w}" for i in range(2) for w in ("w1", "w3", "w2")]
ROUTERS = ["layers.0.moe.router.gate", "layers.1.moe.router.gate"]


def _model(seed: int = 0, **overrides) -> Qwen3MoeModel:
    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug"], n_layers=2, **overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeModel(args)
    model.init_weights()
    return model


def _experts(recipe: str = "rowwise", **kw) -> GroupedExpertsConverter:
    return GroupedExpertsConverter.Config(recipe_name=recipe, **kw).build(context=context())


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "blockwise"])
def test_converted_experts_compute_the_quantized_gemms_not_the_bf16_ones(recipe):
    model = _model()
    experts = model.layers["0"].moe.experts
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    counts = torch.tensor([0, 9, 3, 7, 1, 16, 4, 0])
    before = experts(x, counts)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _experts(recipe).convert(model)
    assert isinstance(experts.__dict__["grouped_mm"], QuantizedGroupedMM)
    assert {k: v for k, v in model.state_dict().items()}.keys() == state.keys()  # checkpoints are unchanged
    after = experts(x, counts)
    # Negative control: a converter that left the experts in bf16 would give `before` exactly.
    assert not torch.equal(after, before)
    # ... and what it computes is the quantized recipe, GEMM by GEMM.
    offsets = torch.cumsum(counts, 0).to(torch.int32)

    def mm(a, w):
        return quantized_grouped_mm(a, w.to(a.dtype).transpose(-2, -1), offsets, recipe=recipe, emulate=True)

    h = torch.nn.functional.silu(mm(x, experts.w1)) * mm(x, experts.w3)
    torch.testing.assert_close(after, mm(h, experts.w2), rtol=0, atol=0)


def test_composes_with_the_dense_float8_converter_and_the_router_stays_float32():
    from torchao.float8.float8_linear import Float8Linear

    model = _model()
    reference = _model()
    container = ModelConvertersContainer.Config(converters=[
        Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["output"]),
        GroupedExpertsConverter.Config(recipe_name="rowwise"),
    ]).build(context=context())
    container.convert(model)
    modules = dict(model.named_modules())
    assert all(isinstance(modules[f"layers.{i}.attention.{p}"], Float8Linear)
               for i in range(2) for p in ("wq", "wk", "wv", "wo"))
    assert all(type(modules[fqn]) is nn.Linear for fqn in ROUTERS)
    assert all(isinstance(modules[f"layers.{i}.moe.experts"].__dict__.get("grouped_mm"), QuantizedGroupedMM)
               for i in range(2))
    tokens = _tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens).float().square().mean()
        ref_loss = reference(tokens).float().square().mean()
    loss.backward()
    assert torch.isfinite(loss) and loss != ref_loss
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_two_expert_converters_are_refused():
    with pytest.raises(ValueError, match=r"\[0\] \(moe_experts\) and \[1\] \(moe_experts\) both convert grouped experts"):
        ModelConvertersContainer.Config(converters=[GroupedExpertsConverter.Config(),
                                                    GroupedExpertsConverter.Config(recipe_name="mxfp8")])


def test_plan_lists_every_expert_gemm_and_the_router_with_its_reason():
    model = _model()
    text = _experts().explain(model)
    assert "12" not in text.splitlines()[1]  # 2 layers: 6 expert GEMMs
    assert "Expert plan: 6 of 6 expert grouped GEMMs run in low precision" in text
    lines = {line.split()[0]: line for line in text.splitlines()[3:]}
    assert list(lines) == EXPERT_GEMMS + ROUTERS
    assert all(lines[fqn].split()[1:5] == ["8", "128", "128", "rowwise"] for fqn in EXPERT_GEMMS)
    assert all("router gate: float32 in every recipe" in lines[fqn] for fqn in ROUTERS)
    assert "token groups padded to 16 rows" in text and "grouped GEMMs emulated: cpu" in text


def test_filter_and_shape_rules_keep_experts_in_high_precision():
    model = _model()
    rows = {r.fqn: r for r in _experts(filter_fqns=["layers.1.moe.experts"]).plan_rows(model)}
    assert rows["layers.1.moe.experts.w2"].reason == "filter_fqns entry 'layers.1.moe.experts'"
    assert rows["layers.0.moe.experts.w2"].recipe == "rowwise"
    with pytest.raises(ValueError, match="runs all its grouped GEMMs in one recipe"):
        _experts(filter_fqns=["experts.w2"]).convert(model)
    narrow = _model(moe=dataclasses.replace(QWEN3_MOE_FLAVORS["debug"].moe, hidden_dim=48))
    rows = {r.fqn: r for r in _experts("mxfp8").plan_rows(narrow)}
    assert rows["layers.0.moe.experts.w1"].reason == "dims not divisible by 32 (mxfp8 grouped GEMM alignment)"
    assert rows["layers.0.moe.experts.w1"].recipe is None
    # Blockwise: 32-aligned but not 128 (hidden 96) keeps the experts in high precision, with the tile as the reason.
    narrow = _model(moe=dataclasses.replace(QWEN3_MOE_FLAVORS["debug"].moe, hidden_dim=96))
    rows = {r.fqn: r for r in _experts("blockwise").plan_rows(narrow)}
    for name in ("w1", "w3", "w2"):
        row = rows[f"layers.0.moe.experts.{name}"]
        assert (row.recipe, row.reason) == (None, "dims not multiples of 128 (1x128 tiles, 128x128 weight blocks)")
    _experts("blockwise").convert(narrow)
    assert "grouped_mm" not in vars(narrow.layers["0"].moe.experts)


def test_the_dense_float8_plan_keeps_the_router_gate_in_float32():
    # At 30B width (dim 2048, 128 experts) the gate would pass every shape rule: only the router's own
    # declaration keeps it out of FP8.
    with torch.device("meta"):
        model = Qwen3MoeModel(dataclasses.replace(QWEN3_MOE_FLAVORS["30B-A3B"], n_layers=1))
    rows = {r.fqn: r for r in float8_plan(model, Float8LinearConverter.Config(recipe_name="rowwise"),
                                          output_module="output", blocks="layers")}
    assert rows["layers.0.moe.router.gate"].recipe is None
    assert rows["layers.0.moe.router.gate"].reason.startswith("router gate: float32 in every recipe")
    assert rows["layers.0.attention.wq"].recipe == "rowwise"


@pytest.mark.parametrize("recipe, kernel, device_type, capability, built, emulate, why", [
    ("rowwise", "auto", "cpu", None, True, True, "cpu has no rowwise grouped GEMM kernels"),
    ("rowwise", "auto", "cuda", (9, 0), True, False, "torchao rowwise grouped GEMM kernels on GPU (compute capability 9.0)"),
    ("rowwise", "auto", "cuda", (8, 9), True, True, "lacks them (they need compute capability 9.0+ (Hopper))"),
    ("rowwise", "auto", "cuda", (9, 0), False, True, "this torchao build lacks the rowwise grouped GEMM kernels"),
    ("mxfp8", "auto", "cuda", (9, 0), True, True, "they need compute capability 10.0+ (Blackwell)"),
    ("mxfp8", "native", "cuda", (10, 0), True, False, "torchao mxfp8 grouped GEMM kernels"),
    ("mxfp8", "auto", "cuda", None, True, None, "decided on the GPU at launch"),
    ("mxfp8", "emulated", "cuda", (10, 0), True, True, "as kernel='emulated' asks"),
    # Blockwise: torchao's grouped blockwise GEMM where DeepGEMM runs (deep_gemm '' = usable), else emulated.
    ("blockwise", "auto", "cpu", None, True, True, "cpu has no blockwise grouped GEMM kernel (it needs an NVIDIA GPU "
                                                   "of compute capability 9.0+ (Hopper) and deep_gemm)"),
    ("blockwise", "auto", "cuda", (9, 0), True, False, "torchao's grouped blockwise FP8 GEMM (DeepGEMM) on GPU "
                                                       "(compute capability 9.0)"),
    ("blockwise", "auto", "cuda", (8, 9), True, True, "GPU (compute capability 8.9) lacks it (it needs an NVIDIA GPU "
                                                      "of compute capability 9.0+ (Hopper))"),
    ("blockwise", "auto", "cuda", None, True, None, "decided on the GPU at launch (torchao's grouped blockwise FP8 "
                                                    "GEMM (DeepGEMM) on an NVIDIA GPU of compute capability 9.0+"),
    ("blockwise", "emulated", "cuda", (9, 0), True, True, "as kernel='emulated' asks"),
])
def test_kernel_decision(recipe, kernel, device_type, capability, built, emulate, why):
    decision = decide_grouped_kernel(recipe, kernel, device_type, capability, "GPU", built)
    assert decision.emulate is emulate and why in decision.why


NO_DEEP_GEMM = "the deep_gemm package is not installed"


@pytest.mark.parametrize("capability, deep_gemm, power_of_2, dtype, why", [
    ((9, 0), NO_DEEP_GEMM, False, torch.bfloat16, "grouped GEMMs emulated: the deep_gemm package is not installed "
                                                  "(torchao runs its blockwise grouped GEMMs on DeepGEMM); same tiles "
                                                  "and scales, GEMM in float32 (float32 scales)"),
    ((10, 0), "", True, torch.bfloat16, "power_of_2_scales=true: torchao's blockwise kernels compute float32 scales "
                                        "448 / amax, never powers of 2; same tiles and scales, GEMM in the compute "
                                        "dtype"),
    ((9, 0), "", False, torch.float32, "the compute dtype is float32 and the kernel writes bfloat16 only"),
    # Every reason is named, not just the first.
    ((8, 0), NO_DEEP_GEMM, True, torch.bfloat16, "lacks it (it needs an NVIDIA GPU of compute capability 9.0+ "
                                                 "(Hopper)); power_of_2_scales=true"),
])
def test_blockwise_emulates_with_each_reason(capability, deep_gemm, power_of_2, dtype, why):
    decision = decide_grouped_kernel("blockwise", "auto", "cuda", capability, "GPU", power_of_2=power_of_2,
                                     deep_gemm=deep_gemm, compute_dtype=dtype)
    assert decision.emulate is True and why in decision.why
    # Where the GPU lacks sm_90 the deep_gemm probe's answer is not consulted (it is not even run).
    assert (NO_DEEP_GEMM in decision.why) is (capability >= (9, 0) and bool(deep_gemm))


@pytest.mark.parametrize("recipe, device_type, capability, message", [
    ("rowwise", "cpu", None, "needs an NVIDIA GPU with compute capability 9.0+ (Hopper), and this run computes on cpu"),
    ("mxfp8", "cuda", (9, 0), "GPU (compute capability 9.0) lacks them (they need compute capability 10.0+"),
    ("blockwise", "cpu", None, "model_converters.converters[moe_experts].kernel='native' with recipe_name='blockwise' "
                               "needs torchao's grouped blockwise FP8 GEMM (DeepGEMM): cpu has no blockwise grouped "
                               "GEMM kernel (it needs an NVIDIA GPU of compute capability 9.0+ (Hopper) and "
                               "deep_gemm). Fix: run on an NVIDIA GPU of compute capability 9.0+ (Hopper); or use "
                               "kernel='auto' or kernel='emulated' to emulate (same tiles and scales, GEMM in float32 "
                               "(float32 scales); slower than BF16)"),
])
def test_native_without_the_kernels_is_an_error(recipe, device_type, capability, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        decide_grouped_kernel(recipe, "native", device_type, capability, "GPU")


def test_native_blockwise_names_what_is_missing_and_the_fix():
    with pytest.raises(ValueError, match=re.escape(
            "needs torchao's grouped blockwise FP8 GEMM (DeepGEMM): the deep_gemm package is not installed (torchao "
            "runs its blockwise grouped GEMMs on DeepGEMM); power_of_2_scales=true: torchao's blockwise kernels "
            "compute float32 scales 448 / amax, never powers of 2. Fix: install DeepGEMM "
            "(https://github.com/deepseek-ai/DeepGEMM) built against this torch and CUDA: it compiles CUDA code "
            "(nvcc), and PyPI's deep_gemm 1.0.0 sdist ships no CUDA headers; set power_of_2_scales=false; or use "
            "kernel='auto' or kernel='emulated' to emulate (same tiles and scales, GEMM in the compute dtype")):
        decide_grouped_kernel("blockwise", "native", "cuda", (9, 0), "GPU", power_of_2=True, deep_gemm=NO_DEEP_GEMM)
    with pytest.raises(ValueError, match=re.escape(
            "GPU (compute capability 8.0) lacks it (it needs an NVIDIA GPU of compute capability 9.0+ (Hopper)); the "
            "compute dtype is float32 and the kernel writes bfloat16 only. Fix: run on an NVIDIA GPU of compute "
            "capability 9.0+ (Hopper); use precision.param_dtype=bfloat16; or use")):
        decide_grouped_kernel("blockwise", "native", "cuda", (8, 0), "GPU", compute_dtype=torch.float32)
    decision = decide_grouped_kernel("blockwise", "native", "cuda", (9, 0), "H100")
    assert decision.emulate is False and decision.why == ("torchao's grouped blockwise FP8 GEMM (DeepGEMM) on H100 "
                                                          "(compute capability 9.0)")


def test_converter_probes_deep_gemm_only_on_hopper_blockwise(monkeypatch, caplog):
    probes = []
    monkeypatch.setattr(moe_experts_module, "deep_gemm_missing", lambda: probes.append(1) or NO_DEEP_GEMM)
    GroupedExpertsConverter.Config(recipe_name="blockwise").build(context=context())  # CPU: no probe
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert GroupedExpertsConverter.Config(recipe_name="blockwise").build(context=context(device_type="cuda")).kernel.emulate
    assert probes == []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        converter = GroupedExpertsConverter.Config(recipe_name="blockwise").build(context=context(device_type="cuda"))
    assert converter.kernel.emulate is True and probes == [1]
    assert caplog.text.count("grouped GEMMs emulated: the deep_gemm package is not installed") == 1
    monkeypatch.setattr(moe_experts_module, "deep_gemm_missing", lambda: "")
    converter = GroupedExpertsConverter.Config(recipe_name="blockwise").build(context=context(device_type="cuda"))
    assert converter.kernel.emulate is False
    assert "torchao's grouped blockwise FP8 GEMM (DeepGEMM) on NVIDIA H100 80GB HBM3" in converter.settings()


def test_deep_gemm_probe_without_the_package(monkeypatch):
    # The probe answers from the package index alone: torchao's kernels (which import triton) stay unimported.
    # The index is made to lack deep_gemm, so the case runs (and means the same) where the package is installed.
    from torchtitan_lite.components.quantization import blockwise_grouped_kernel
    from torchtitan_lite.components.quantization.blockwise_grouped_kernel import deep_gemm_missing

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(blockwise_grouped_kernel.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deep_gemm" else find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels", raising=False)
    assert deep_gemm_missing() == NO_DEEP_GEMM
    assert "torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels" not in sys.modules


def test_choice_is_logged_once_and_precision_rules(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(moe_experts_module, "native_kernels_built", lambda recipe: True)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        converter = GroupedExpertsConverter.Config().build(context=context(device_type="cuda"))
    assert converter.kernel.emulate is False
    assert caplog.text.count("torchao rowwise grouped GEMM kernels on NVIDIA H100 80GB HBM3") == 1
    with pytest.raises(ValueError, match="write bfloat16 only, which precision.param_dtype=float32 cannot take"):
        GroupedExpertsConverter.Config().build(context=context("float32", device_type="cuda"))
    with pytest.raises(ValueError, match="precision.param_dtype=float16"):
        GroupedExpertsConverter.Config().build(context=context("float16"))
    with pytest.raises(ValueError, match=r"recipe_name='tensorwise' is not one of: rowwise, mxfp8, blockwise"):
        GroupedExpertsConverter.Config(recipe_name="tensorwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(
            "model_converters.converters[moe_experts].power_of_2_scales=true applies to recipe_name='blockwise' only: "
            "mxfp8's scales are powers of two already. Remove power_of_2_scales or use recipe_name='blockwise'")):
        GroupedExpertsConverter.Config(recipe_name="mxfp8", power_of_2_scales=True)
    # Blockwise emulates in float32 as well (CPU tests and float32 runs).
    assert GroupedExpertsConverter.Config(recipe_name="blockwise").build(context=context("float32")).kernel.emulate


def test_blockwise_refuses_an_expert_tensor_parallel_split_that_cuts_its_tiles():
    # Expert TP splits the hidden dim (w1 / w3 dim 1, w2 dim 2: the families' expert_shard_dims); qwen3_moe debug's
    # hidden 128 leaves 64 per rank at tp=2.
    dims = {"w1": 1, "w3": 1, "w2": 2}
    ctx = dataclasses.replace(context(tp=True), tp=2, tp_shard_dim=lambda fqn: dims.get(fqn.rsplit(".", 1)[-1]))
    converter = GroupedExpertsConverter.Config(recipe_name="blockwise").build(context=ctx)
    model = _model()
    with pytest.raises(ValueError, match=re.escape(
            "parallelism.tp=2 would cut 6 module(s) whose shards must hold whole 1x128 tiles and 128x128 weight blocks "
            "(the split dim / tp a multiple of 128): model_converters.converters[moe_experts]: layers.{0,1}.moe.experts.w1 "
            "(8 experts, 128 -> 128, expert TP splits out_features 128 / 2 = 64); layers.{0,1}.moe.experts.w3 (8 experts, "
            "128 -> 128, expert TP splits out_features 128 / 2 = 64); layers.{0,1}.moe.experts.w2 (8 experts, 128 -> 128, "
            "expert TP splits in_features 128 / 2 = 64). Fix: use parallelism.tp in [1], or keep exactly these in high "
            "precision: add 'moe.experts' to model_converters.converters[moe_experts].filter_fqns")):
        converter.convert(model)
    # Filtered out, the experts are not checked; rowwise has no such rule.
    GroupedExpertsConverter.Config(recipe_name="blockwise", filter_fqns=["moe.experts"]).build(context=ctx).convert(
        model)
    GroupedExpertsConverter.Config(recipe_name="rowwise").build(context=ctx).convert(model)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "blockwise"])
def test_fp8_stats_measure_every_expert_gemm(recipe):
    model = _model()
    dense = {"mxfp8": MXLinearConverter.Config(), "rowwise": Float8LinearConverter.Config(recipe_name="rowwise"),
             "blockwise": Float8BlockwiseConverter.Config()}[recipe]
    ModelConvertersContainer.Config(converters=[dense, GroupedExpertsConverter.Config(recipe_name=recipe)]).build(
        context=context(compile_model=False)).convert(model)  # eager: MX compiled for CPU is checked on build
    collector = Fp8StatsCollector([model], freq=1)
    with collector.capture(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(_tokens()).float().square().mean().backward()
    health = {h.fqn: h for h in collector.collect()}
    for fqn in EXPERT_GEMMS:
        h = health[fqn]
        assert set(h.amax) == {"input", "weight", "grad_output"}
        # Blockwise reads the same 128x128 weight blocks in both GEMMs: no separate input-gradient weight cast.
        extra = set() if recipe == "blockwise" else {"weight_gi"}
        assert set(h.underflow) == {"input", "weight", "grad_output", "input_gw", "grad_output_gw"} | extra
        # Measured, not defaulted: the weight's amax is the parameter's.
        weight = dict(model.named_parameters())[fqn]
        assert h.amax["weight"] == pytest.approx(float(weight.detach().bfloat16().abs().max()), rel=0)
        assert 20.0 < h.output_sqnr_db < 40.0  # an e4m3 GEMM of bf16 operands (see test_moe_grouped_fp8)
    assert "layers.0.attention.wq" in health and not any("router" in fqn for fqn in health)
    # Nothing is left installed after the stats micro-batch.
    assert all(not model.layers[str(i)].moe.experts.__dict__["grouped_mm"].observer for i in range(2))


@pytest.mark.parametrize("config, first_table", [("qwen3_moe_debug_fp8", "float8 converter"),
                                                 ("qwen3_moe_30b_a3b_fp8_experts", "moe_experts converter")])
def test_print_fp8_plan_shows_the_expert_table(config, first_table, capsys):
    from config_registry import DEFAULT_REGISTRY
    from torchtitan_lite.actions import run_action
    from torchtitan_lite.config import parse_cli

    cli = parse_cli(["--config", config, "--print-fp8-plan"], registry=DEFAULT_REGISTRY)
    assert run_action(cli, registry=DEFAULT_REGISTRY) == 0
    out = capsys.readouterr().out
    assert out.startswith(first_table)
    layers = 4 if "debug" in config else 48
    assert f"Expert plan: {3 * layers} of {3 * layers} expert grouped GEMMs run in low precision" in out
    assert f"{layers} router Linear(s) stay in float32" in out
    assert f"layers.{layers - 1}.moe.experts.w2" in out


def test_power_of_2_blockwise_experts_are_emulated_in_the_compute_dtype():
    decision = decide_grouped_kernel("blockwise", "auto", "cpu", None, power_of_2=True)
    assert decision.emulate and "GEMM in the compute dtype (power-of-2 scales are exact in it)" in decision.why


@pytest.mark.parametrize("recipe, power_of_2", [("mxfp8", False), ("blockwise", False), ("blockwise", True)])
def test_compiled_converted_experts_match_eager_bit_for_bit(recipe, power_of_2):
    # Blockwise's float32 grouped GEMMs (float32 scales) run eagerly inside the compiled graph (torch._grouped_mm
    # traces bf16 only); with power-of-2 scales its bf16 grouped GEMMs are traced with the rest.
    model = _model()
    _experts(recipe, **({"power_of_2_scales": True} if power_of_2 else {})).convert(model)
    experts = model.layers["0"].moe.experts
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    counts = torch.tensor([0, 9, 3, 7, 1, 16, 4, 0])
    eager = experts(x, counts)
    compiled = torch.compile(experts, backend="aot_eager")(x, counts)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_high_precision_validation_runs_the_experts_in_bf16_and_restores_them():
    from torchtitan_lite.components.quantization.low_precision_linears import high_precision_linears

    model = _model()
    experts = model.layers["0"].moe.experts
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    counts = torch.tensor([0, 9, 3, 7, 1, 16, 4, 0])
    bf16 = experts(x, counts)
    _experts().convert(model)
    quantized = experts(x, counts)
    with high_precision_linears([model]) as switched:
        assert switched == 2
        torch.testing.assert_close(experts(x, counts), bf16, rtol=0, atol=0)
    torch.testing.assert_close(experts(x, counts), quantized, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_the_speed_filter_is_refused_where_no_size_rule_is_known(recipe):
    with pytest.raises(ValueError, match=(r"model_converters.converters\[moe_experts\].filter_fqns entry "
                                          r"'auto_filter_small_kn' has a size rule for recipe_name='rowwise' only")):
        GroupedExpertsConverter.Config(recipe_name=recipe, filter_fqns=["auto_filter_small_kn"])


@pytest.mark.parametrize("compile_model, warned", [(False, True), (True, False)])
def test_experts_alone_in_fp8_without_compile_warn_like_the_linear_converters(monkeypatch, caplog, compile_model,
                                                                              warned):
    """A config whose only FP8 part is the experts gets the same compile advice as a float8 one (on Hopper, where
    torchao's kernels run; an emulation is slower than BF16 either way)."""
    from torchtitan_lite.components.quantization import moe_experts

    monkeypatch.setattr(moe_experts, "_cuda_device", lambda device_type: ((9, 0), "NVIDIA H100"))
    monkeypatch.setattr(moe_experts, "native_kernels_built", lambda recipe: True)
    with caplog.at_level(logging.WARNING):
        converter = GroupedExpertsConverter(GroupedExpertsConverter.Config(recipe_name="rowwise"),
                                            context=context(device_type="cuda", compile_model=compile_model))
    assert converter.kernel.emulate is False
    assert ("grouped experts without torch.compile of the model are usually slower than BF16" in caplog.text) is warned
