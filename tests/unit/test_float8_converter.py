"""Float8 converter rules: every error and warning, and the torchao config it builds."""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch
import torch.nn as nn
from _conversion import context
from torchao.float8 import ScalingGranularity

from torchtitan_lite.components.quantization.float8 import Float8LinearConverter

FSDP = True
NO_FSDP = False


def _job(param_dtype: str = "bfloat16", compile_enable: bool = True, components=("model", "loss")) -> dict:
    return dict(param_dtype=param_dtype, compile_model=compile_enable and "model" in components)


def _build(parallel_dims=FSDP, job=None, **fields) -> Float8LinearConverter:
    return Float8LinearConverter.Config(**fields).build(context=context(fsdp=bool(parallel_dims), **(job or _job())))


def _raises(message: str):
    return pytest.raises(ValueError, match=re.escape(message))


# ------------------------------------------------------------------------------------------------
# Config-level rules


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_with_fp8_all_gather_names_the_fix(recipe):
    with _raises(f"model_converters.converters[float8]: enable_fsdp_float8_all_gather=True needs "
                 f"recipe_name='tensorwise', got '{recipe}' (per-row scales do shard along dim 0 with the weight, "
                 f"but the input-gradient GEMM (dX = dY W) needs the weight scaled along its other axis, so one "
                 f"gathered float8 copy cannot serve both GEMMs). Set enable_fsdp_float8_all_gather=false or use "
                 f"recipe_name='tensorwise' (or the float8_blockwise converter, whose 128x128 weight blocks serve "
                 f"both GEMMs)"):
        Float8LinearConverter.Config(recipe_name=recipe, enable_fsdp_float8_all_gather=True)


def test_precompute_without_fp8_all_gather_is_an_error():
    with _raises("precompute_float8_dynamic_scale_for_fsdp=True needs enable_fsdp_float8_all_gather=True (the "
                 "precomputed scales are those of the float8 all-gathered weights). Set "
                 "enable_fsdp_float8_all_gather=true or precompute_float8_dynamic_scale_for_fsdp=false"):
        Float8LinearConverter.Config(precompute_float8_dynamic_scale_for_fsdp=True)


def test_auto_filter_has_no_rule_for_rowwise_with_gw_hp():
    with _raises("model_converters.converters[float8].filter_fqns: 'auto_filter_small_kn' has no size rule for "
                 "recipe_name='rowwise_with_gw_hp'"):
        Float8LinearConverter.Config(recipe_name="rowwise_with_gw_hp", filter_fqns=["auto_filter_small_kn"])


def test_bad_recipe_and_empty_filter_entry():
    with _raises("model_converters.converters[float8].recipe_name='blockwise' is not one of: tensorwise, rowwise, "
                 "rowwise_with_gw_hp; DeepSeek-V3 blockwise FP8 is its own converter: --model_converters.converters "
                 "float8_blockwise"):
        Float8LinearConverter.Config(recipe_name="blockwise")
    with _raises("model_converters.converters[float8].filter_fqns entry '' would match every module"):
        Float8LinearConverter.Config(filter_fqns=["output", ""])


# ------------------------------------------------------------------------------------------------
# Build-time rules (parallelism, precision, compile, hardware)


@pytest.mark.parametrize("parallel_dims", [None, NO_FSDP])
def test_fp8_all_gather_without_fsdp_is_a_logged_no_op(caplog, parallel_dims):
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _build(parallel_dims=parallel_dims, enable_fsdp_float8_all_gather=True)
    assert ("model_converters.converters[float8]: enable_fsdp_float8_all_gather has no effect without FSDP "
            "sharding; ignoring") in caplog.text
    caplog.clear()
    config = Float8LinearConverter.Config(enable_fsdp_float8_all_gather=True,
                                          precompute_float8_dynamic_scale_for_fsdp=True)
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        converter = config.build(context=context(fsdp=bool(parallel_dims), **_job()))
    assert ("model_converters.converters[float8]: enable_fsdp_float8_all_gather and "
            "precompute_float8_dynamic_scale_for_fsdp have no effect without FSDP sharding; ignoring") in caplog.text
    assert converter.float8_config.enable_fsdp_float8_all_gather is False
    assert converter.precompute_scales is False
    assert config.enable_fsdp_float8_all_gather is True  # the config itself is untouched


def test_fp8_all_gather_with_fsdp_reaches_torchao(caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        converter = _build(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    assert converter.float8_config.enable_fsdp_float8_all_gather is True
    assert converter.precompute_scales is True
    assert caplog.text == ""


@pytest.mark.parametrize("compile_enable, components", [(False, ("model", "loss")), (True, ("loss",))])
def test_fp8_without_compiling_the_model_warns(caplog, compile_enable, components):
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _build(job=dict(_job(compile_enable=compile_enable, components=components), device_type="cuda"))
    assert "FP8 training without torch.compile of the model is usually slower than BF16" in caplog.text
    assert "Set compile.enable=true (with 'model' in compile.components) for speed" in caplog.text


@pytest.mark.parametrize("device_type, emulate", [("cpu", False), ("cuda", True)])
def test_fp8_without_compile_does_not_warn_where_compile_would_not_make_it_fast(caplog, device_type, emulate):
    # No CPU has FP8 matrix units and emulation computes in high precision: FP8 there is slower than BF16
    # with or without compile, so the speed advice would not be true.
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _build(job=dict(_job(compile_enable=False), device_type=device_type), emulate=emulate)
    assert "without torch.compile" not in caplog.text


def test_gpu_without_fp8_tensor_cores_suggests_emulate(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with _raises("model_converters.converters[float8]: NVIDIA A100 (compute capability 8.0) has no FP8 tensor cores "
                 "(needs 8.9+, Ada or Hopper). Set model_converters.converters[float8].emulate=true to emulate FP8 "
                 "numerics (slower than BF16), or remove the float8 converter"):
        _build(job=dict(_job(), device_type="cuda"))
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        converter = _build(job=dict(_job(), device_type="cuda"), emulate=True)
    assert converter.float8_config.emulate is True
    assert "emulate=True: FP8 numerics emulated in high precision" in caplog.text


def test_fp8_gpus_and_cpu_need_no_emulation(monkeypatch):
    assert _build().float8_config.emulate is False  # CPU: torch._scaled_mm has a CPU kernel
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    assert _build(job=dict(_job(), device_type="cuda")).float8_config.emulate is False


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_float16_with_a_rowwise_recipe_is_an_error(recipe):
    with _raises(f"model_converters.converters[float8].recipe_name='{recipe}' cannot be combined with "
                 f"precision.param_dtype=float16: the rowwise FP8 GEMM writes only bfloat16, so torchao computes each "
                 f"float16 Linear output in bfloat16 and casts it to float16"):
        _build(job=_job(param_dtype="float16"), recipe_name=recipe)


def test_float16_with_tensorwise_is_allowed_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _build(job=_job(param_dtype="float16"))
    assert ("FP8 with precision.param_dtype=float16 trains with loss scaling, but every FP8-capable GPU supports "
            "bfloat16, which needs none; prefer precision.param_dtype=bfloat16") in caplog.text


@pytest.mark.parametrize("param_dtype", ["bfloat16", "auto"])
def test_rowwise_with_gw_hp_under_cpu_autocast_is_an_error(monkeypatch, param_dtype):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # auto -> bfloat16
    with _raises("recipe_name='rowwise_with_gw_hp' fails on CPU without FSDP when the run computes in "
                 "bfloat16: torchao's Float8Linear casts its input only under CUDA autocast"):
        _build(parallel_dims=NO_FSDP, job=_job(param_dtype=param_dtype), recipe_name="rowwise_with_gw_hp")
    # The FSDP path casts parameters and inputs itself, and float32 needs no autocast: both fine.
    _build(parallel_dims=FSDP, job=_job(param_dtype=param_dtype), recipe_name="rowwise_with_gw_hp")
    _build(parallel_dims=NO_FSDP, job=_job(param_dtype="float32"), recipe_name="rowwise_with_gw_hp")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # auto -> float32
    _build(parallel_dims=NO_FSDP, job=_job(param_dtype="auto"), recipe_name="rowwise_with_gw_hp")


# ------------------------------------------------------------------------------------------------
# The torchao config and the conversion itself


def test_torchao_config_follows_the_recipe():
    tensorwise = _build().float8_config
    rowwise = _build(recipe_name="rowwise").float8_config
    gw_hp = _build(recipe_name="rowwise_with_gw_hp").float8_config
    assert tensorwise.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
    assert tensorwise.round_scales_to_power_of_2 is False
    assert rowwise.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    assert rowwise.round_scales_to_power_of_2 is True
    assert gw_hp.cast_config_weight_for_grad_input.scaling_granularity is ScalingGranularity.TENSORWISE
    assert gw_hp.cast_config_input_for_grad_weight.scaling_type.value == "disabled"


def test_building_never_mutates_the_config():
    config = Float8LinearConverter.Config(enable_fsdp_float8_all_gather=True,
                                          precompute_float8_dynamic_scale_for_fsdp=True, filter_fqns=["output"])
    before = dataclasses.asdict(config)
    for parallel_dims in (None, NO_FSDP, FSDP):
        config.build(context=context(fsdp=bool(parallel_dims), **_job()))
    assert dataclasses.asdict(config) == before


def test_a_bare_linear_cannot_be_converted_in_place():
    with _raises("the float8 converter swaps Linears inside a model in place; pass the parent module"):
        _build().convert(nn.Linear(16, 16))


def test_rowwise_plan_says_why_fsdp_gathers_the_weight_in_high_precision():
    text = _build(parallel_dims=FSDP, recipe_name="rowwise").settings()
    assert text.startswith("recipe rowwise, FSDP float8 all-gather off (per-row scales do shard along dim 0 with the "
                           "weight, but the input-gradient GEMM (dX = dY W) needs the weight scaled along its other "
                           "axis, so one gathered float8 copy cannot serve both GEMMs), precomputed scales off")
    assert "per-row" not in _build(parallel_dims=NO_FSDP, recipe_name="rowwise").settings()
