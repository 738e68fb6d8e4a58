"""Precision section: validation, 'auto' resolution, FSDP policy, autocast contexts, loss-scaler choice."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from torchtitan_lite.components.grad_scaler import GradScaler
from torchtitan_lite.components.precision import Precision, resolve_precision


def _build(fsdp: bool = False, device: str = "cpu", **fields) -> Precision:
    return Precision.Config(**fields).build(device=device, fsdp_enabled=fsdp)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"param_dtype": "fp16"}, "precision.param_dtype='fp16' is not one of: auto, float32, bfloat16, float16"),
        ({"reduce_dtype": "auto"}, "precision.reduce_dtype='auto' is not one of: float32, bfloat16, float16"),
        ({"loss_scaling": "fixed"}, "precision.loss_scaling='fixed' is not one of: auto, dynamic, static, none"),
        ({"init_scale": 0.0}, "precision.init_scale=0.0 must be > 0"),
        ({"growth_factor": 1.0}, "precision.growth_factor=1.0 must be > 1"),
        ({"backoff_factor": 1.0}, "precision.backoff_factor=1.0 must be between 0 and 1"),
        ({"growth_interval": 0}, "precision.growth_interval=0 must be >= 1"),
        ({"min_scale": 0.0}, "precision.min_scale=0.0 must be > 0 and at most precision.init_scale=65536"),
        ({"init_scale": 8.0, "min_scale": 16.0}, "precision.min_scale=16.0 must be > 0 and at most "
                                                 "precision.init_scale=8"),
        ({"hysteresis": 0}, "precision.hysteresis=0 must be >= 1"),
        ({"loss_scaling": "static", "hysteresis": 2, "growth_interval": 100},
         "precision.loss_scaling='static' keeps the loss scale at init_scale=65536, so precision.growth_interval, "
         "precision.hysteresis would do nothing: they only steer a dynamic scale. Remove them, or use "
         "precision.loss_scaling='dynamic'"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Precision.Config(**fields)


def _resolve(device_type: str = "cpu", cuda_available: bool = False, **fields):
    return resolve_precision(Precision.Config(**fields), device_type=device_type, fsdp_enabled=False,
                             cuda_available=cuda_available)


@pytest.mark.parametrize("fast_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_depends_on_bfloat16_kernels(monkeypatch, fast_bf16, expected):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: fast_bf16)
    resolved = _resolve(param_dtype="auto")
    assert resolved.param_dtype == expected
    assert _build(param_dtype="auto").param_dtype == expected  # the component resolves the same way
    if fast_bf16:
        assert resolved.reason == "precision.param_dtype=auto: bfloat16 on CPU (oneDNN bfloat16 kernels available)"
    else:
        assert resolved.reason.startswith("precision.param_dtype=auto: float32, because this CPU has no oneDNN "
                                          "bfloat16 kernels and bfloat16 matmuls would run many times slower")


@pytest.mark.parametrize("capability, expected", [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                                                  ((7, 5), torch.float32)])
def test_auto_on_cuda_depends_on_native_bfloat16(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    resolved = _resolve(param_dtype="auto", device_type="cuda", cuda_available=True)
    assert resolved.param_dtype == expected
    if expected == torch.float32:
        assert resolved.reason.startswith("precision.param_dtype=auto: float32, because FakeGPU has no native "
                                          "bfloat16 (compute capability < 8.0)")


def test_auto_for_a_gpu_job_sized_without_a_gpu_assumes_native_bfloat16():
    resolved = _resolve(param_dtype="auto", device_type="cuda", cuda_available=False)
    assert resolved.param_dtype == torch.bfloat16
    assert "assuming GPUs with native bfloat16 (Ampere or newer): this host has none to ask" in resolved.reason


def test_auto_on_an_unknown_device_type_falls_back_to_float32():
    resolved = _resolve(param_dtype="auto", device_type="meta")
    assert resolved.param_dtype == torch.float32
    assert "bfloat16 support on device type 'meta' is not known here" in resolved.reason


@pytest.mark.parametrize("param, reduce", [("float32", "float32"), ("bfloat16", "float32"), ("float16", "float32"),
                                           ("bfloat16", "bfloat16")])
def test_mp_policy_carries_the_resolved_dtypes(param, reduce):
    policy = _build(fsdp=True, param_dtype=param, reduce_dtype=reduce).mp_policy()
    assert policy.param_dtype == getattr(torch, param)
    assert policy.reduce_dtype == getattr(torch, reduce)
    assert policy.output_dtype is None
    assert policy.cast_forward_inputs is True


def _autocast_dtype(ctx) -> torch.dtype | None:
    with ctx:
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def test_autocast_is_the_non_fsdp_equivalent_of_param_casting():
    assert _autocast_dtype(_build(param_dtype="bfloat16").autocast()) == torch.bfloat16
    assert _autocast_dtype(_build(param_dtype="float16").autocast()) == torch.float16
    assert _autocast_dtype(_build(param_dtype="float32").autocast()) is None
    # FSDP casts parameters itself: autocast on top would be redundant.
    assert isinstance(_build(fsdp=True, param_dtype="bfloat16").autocast(), contextlib.nullcontext)


def test_master_weights_stay_float32_under_autocast():
    model = torch.nn.Linear(16, 16)
    with _build(param_dtype="bfloat16").autocast():
        out = model(torch.randn(2, 16))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32 and model.weight.grad.dtype == torch.float32


def test_eval_autocast_follows_mixed_precision_eval():
    assert _autocast_dtype(_build(param_dtype="bfloat16").eval_autocast()) == torch.bfloat16
    assert _autocast_dtype(_build(param_dtype="bfloat16", mixed_precision_eval=False).eval_autocast()) is None


def test_float32_eval_with_fsdp_low_precision_is_an_error():
    with pytest.raises(ValueError, match=r"precision.mixed_precision_eval=False \(float32 evaluation\) cannot be "
                                         r"honoured with FSDP: FSDP casts parameters to param_dtype=bfloat16"):
        _build(fsdp=True, param_dtype="bfloat16", mixed_precision_eval=False)
    _build(fsdp=True, param_dtype="float32", mixed_precision_eval=False)  # nothing to honour: fine


@pytest.mark.parametrize(
    "param, scaling, expected",
    [("float16", "auto", True), ("bfloat16", "auto", False), ("float32", "auto", False),
     ("float16", "none", False), ("bfloat16", "dynamic", True)],
)
def test_loss_scaling_resolution(param, scaling, expected):
    scaler = _build(param_dtype=param, loss_scaling=scaling, init_scale=1024.0, growth_interval=7).grad_scaler()
    assert (scaler is not None) == expected
    if expected:
        assert isinstance(scaler, GradScaler)
        assert scaler.scale_value == 1024.0 and scaler.growth_interval == 7


def test_static_and_megatron_settings_reach_the_scaler():
    static = _build(param_dtype="float16", loss_scaling="static", init_scale=512.0)
    scaler = static.grad_scaler()
    assert scaler is not None and not scaler.dynamic and scaler.scale_value == 512.0
    assert static.describe() == "param float16, reduce float32 via autocast, static loss scale 512"
    dynamic = _build(param_dtype="float16", min_scale=4.0, hysteresis=2).grad_scaler()
    assert dynamic is not None and dynamic.dynamic
    assert (dynamic.min_scale, dynamic.hysteresis, dynamic.hysteresis_left) == (4.0, 2, 2)


def test_questionable_combinations_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        _build(param_dtype="float16", loss_scaling="none")
        _build(param_dtype="bfloat16", loss_scaling="dynamic")
        _build(param_dtype="bfloat16", reduce_dtype="bfloat16")
    assert "param_dtype=float16 with loss_scaling=none: small gradients underflow" in caplog.text
    assert "loss_scaling=dynamic with param_dtype=bfloat16: loss scaling only matters for float16" in caplog.text
    assert "precision.reduce_dtype=bfloat16 has no effect without FSDP" in caplog.text
