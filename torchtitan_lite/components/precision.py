"""The precision policy: parameter / compute dtype, gradient-reduction dtype, FP16 loss scaling.

Master weights and optimizer states always stay in float32. Low precision is applied on the fly:

- with FSDP2, ``mp_policy()`` makes FSDP cast the all-gathered parameters to ``param_dtype`` for
  forward/backward and reduce-scatter gradients in ``reduce_dtype``;
- without FSDP (one device, or TP only), ``autocast()`` is the equivalent: ``torch.autocast`` runs
  matmul-like ops in ``param_dtype`` while the parameters themselves stay float32. It is not
  bit-identical to FSDP's casting: autocast keeps numerically sensitive ops (softmax, norms,
  reductions) in float32, whereas FSDP casts every parameter, norms included.

FP8 is orthogonal: the float8 converter swaps Linears on top of this 16/32-bit policy.
"""
from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchtitan_lite.components.grad_scaler import GradScaler
from torchtitan_lite.config import Configurable

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARAM_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
REDUCE_DTYPE_CHOICES = ("float32", "bfloat16", "float16")
LOSS_SCALING_CHOICES = ("auto", "dynamic", "static", "none")
# The settings that only a dynamic scaler reads: a static scale with any of them changed is an error.
DYNAMIC_SCALER_FIELDS = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "hysteresis")


class Precision(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
        """Compute dtype of parameters in forward/backward (master weights stay float32). 'auto' picks
        bfloat16 on CUDA GPUs with native bfloat16 (Ampere and newer) and on CPUs with oneDNN bfloat16
        kernels (AVX-512), float32 elsewhere (the reason is logged). float16 needs loss scaling."""
        reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
        """Dtype of the FSDP gradient reduce-scatter / all-reduce. float32 keeps gradient sums exact
        enough for long runs; only meaningful with FSDP (without FSDP gradients stay float32)."""
        loss_scaling: Literal["auto", "dynamic", "static", "none"] = "auto"
        """'auto' = dynamic loss scaling exactly when param_dtype is float16; 'dynamic' forces it on;
        'static' multiplies the loss by the constant init_scale (steps whose gradients overflow are still
        skipped); 'none' turns it off (float16 without scaling loses small gradients to underflow)."""
        init_scale: float = 2.0**16
        """Initial loss scale for dynamic loss scaling; the constant scale for static loss scaling."""
        growth_factor: float = 2.0
        """Factor the loss scale grows by after growth_interval steps without overflow (> 1). Dynamic only."""
        backoff_factor: float = 0.5
        """Factor the loss scale shrinks by once hysteresis overflows have been seen (0..1). Every overflowing
        step is skipped. Dynamic only."""
        growth_interval: int = 2000
        """Consecutive overflow-free steps before the loss scale grows. Dynamic only."""
        min_scale: float = 1.0
        """The loss scale never backs off below this (Megatron-LM's --min-loss-scale); an overflow at it is
        skipped with a warning. Between 0 and init_scale. Dynamic only."""
        hysteresis: int = 1
        """Overflows tolerated before the scale backs off (Megatron-LM's --hysteresis, 2 there): each overflow
        takes one off a counter that only refills when the scale grows. 1 backs off at every overflow, as
        torch.amp.GradScaler does. Dynamic only."""
        mixed_precision_eval: bool = True
        """Run validation forward passes in param_dtype like training (True) or in float32 (False).
        float32 evaluation needs the non-FSDP path: FSDP casts parameters to param_dtype in every forward.
        Linears converted to FP8 / MX follow validation.low_precision."""

        def __post_init__(self) -> None:
            _check_choice("precision.param_dtype", self.param_dtype, PARAM_DTYPE_CHOICES)
            _check_choice("precision.reduce_dtype", self.reduce_dtype, REDUCE_DTYPE_CHOICES)
            _check_choice("precision.loss_scaling", self.loss_scaling, LOSS_SCALING_CHOICES)
            if not self.init_scale > 0:
                raise ValueError(f"precision.init_scale={self.init_scale} must be > 0; the default is 65536")
            if not self.growth_factor > 1.0:
                raise ValueError(f"precision.growth_factor={self.growth_factor} must be > 1; the default is 2.0")
            if not 0.0 < self.backoff_factor < 1.0:
                raise ValueError(
                    f"precision.backoff_factor={self.backoff_factor} must be between 0 and 1 (exclusive); "
                    f"the default is 0.5"
                )
            if self.growth_interval < 1:
                raise ValueError(f"precision.growth_interval={self.growth_interval} must be >= 1; the default is 2000")
            if not 0.0 < self.min_scale <= self.init_scale:
                raise ValueError(
                    f"precision.min_scale={self.min_scale} must be > 0 and at most precision.init_scale="
                    f"{self.init_scale:g} (the scale starts at init_scale and never backs off below min_scale); "
                    f"the default is 1.0"
                )
            if self.hysteresis < 1:
                raise ValueError(f"precision.hysteresis={self.hysteresis} must be >= 1 (1 backs off at every "
                                 f"overflow); the default is 1")
            if self.loss_scaling == "static":
                changed = [name for name in DYNAMIC_SCALER_FIELDS
                           if getattr(self, name) != type(self).__dataclass_fields__[name].default]
                if changed:
                    raise ValueError(
                        f"precision.loss_scaling='static' keeps the loss scale at init_scale={self.init_scale:g}, so "
                        f"{', '.join(f'precision.{name}' for name in changed)} would do nothing: they only steer a "
                        f"dynamic scale. Remove them, or use precision.loss_scaling='dynamic'"
                    )

    config: Precision.Config

    def __init__(self, config: Precision.Config, *, device: torch.device | str,
                 resolved: ResolvedPrecision | None = None, fsdp_enabled: bool = False) -> None:
        """``resolved`` is the run's decision (trainer); without it the config is resolved here for
        ``device`` and ``fsdp_enabled`` (tools and tests that build a precision on their own)."""
        self.config = config
        self.device = torch.device(device)
        if resolved is None:
            resolved = resolve_precision(config, device_type=self.device.type, fsdp_enabled=fsdp_enabled)
        self.fsdp_enabled = resolved.fsdp
        self.param_dtype = resolved.param_dtype
        self.reduce_dtype = resolved.reduce_dtype
        self.loss_scaling = resolved.loss_scaling
        self.resolved = resolved

    # ----------------------------------------------------------------------------------------------

    def mp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2 policy: cast params to param_dtype for compute, reduce gradients in reduce_dtype.

        Outputs keep param_dtype (output_dtype=None); the loss upcasts the logits itself.
        """
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, output_dtype=None, cast_forward_inputs=True
        )

    def autocast(self) -> AbstractContextManager[None]:
        """Context for the training forward: torch.autocast in param_dtype on the non-FSDP path.

        With FSDP, or in float32, it does nothing: FSDP's mp_policy already casts the parameters.
        """
        if self.fsdp_enabled or self.param_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.param_dtype)

    def eval_autocast(self) -> AbstractContextManager[None]:
        """Context for validation forwards: like ``autocast()``, or float32 when mixed_precision_eval=False."""
        if not self.config.mixed_precision_eval:
            return contextlib.nullcontext()
        return self.autocast()

    def grad_scaler(self, process_group: dist.ProcessGroup | None = None) -> GradScaler | None:
        """A loss scaler (dynamic or static) when loss scaling is on, else None.

        ``process_group`` is the group over which an overflow on any rank makes every rank skip;
        None means all ranks (the default group) once a process group exists.
        """
        if not self.loss_scaling:
            return None
        cfg = self.config
        return GradScaler(
            init_scale=cfg.init_scale, growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval, min_scale=cfg.min_scale, hysteresis=cfg.hysteresis,
            dynamic=not self.resolved.static_loss_scale, device=self.device, process_group=process_group,
        )

    def describe(self) -> str:
        return self.resolved.describe(init_scale=self.config.init_scale)


@dataclass(frozen=True)
class ResolvedPrecision:
    """What the precision settings mean for one run on one kind of device: decided once, read by the
    trainer, the float8 converter, the memory estimate and --check-config alike."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    fsdp: bool
    """Low precision comes from FSDP's mixed-precision policy (else from autocast, or none in float32)."""
    loss_scaling: bool
    reason: str
    """Why param_dtype is what it is (for 'auto': the device's bfloat16 support)."""
    static_loss_scale: bool = False
    """With loss_scaling: the scale is the constant init_scale (else it adapts dynamically)."""

    @property
    def autocast(self) -> bool:
        """Training forwards run under torch.autocast (no FSDP, below float32)."""
        return not self.fsdp and self.param_dtype != torch.float32

    @property
    def param_bytes(self) -> int:
        return torch.tensor([], dtype=self.param_dtype).element_size()

    def describe(self, *, init_scale: float | None = None) -> str:
        scaling = ""
        if self.loss_scaling and self.static_loss_scale:
            scaling = ", static loss scale" + (f" {init_scale:g}" if init_scale is not None else "")
        elif self.loss_scaling:
            scaling = ", dynamic loss scaling" + (f" from {init_scale:g}" if init_scale is not None else "")
        if self.fsdp:
            path = "FSDP mixed-precision policy"
        else:
            path = "autocast" if self.autocast else "no autocast (float32)"
        return f"param {_name(self.param_dtype)}, reduce {_name(self.reduce_dtype)} via {path}{scaling}"


def resolve_precision(config: Precision.Config, *, device_type: str, fsdp_enabled: bool,
                      cuda_available: bool | None = None) -> ResolvedPrecision:
    """Resolve 'auto' and check the combination for ``device_type`` ('cuda' or 'cpu').

    ``cuda_available`` (default: whether this process sees a GPU) False with device_type 'cuda' sizes a
    CUDA job from a host without one: 'auto' then assumes a GPU with native bfloat16 (Ampere or newer).
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    param_dtype, reason = _resolve_param_dtype(config.param_dtype, device_type, cuda_available)
    loss_scaling = (config.loss_scaling in ("dynamic", "static")
                    or (config.loss_scaling == "auto" and param_dtype == torch.float16))
    resolved = ResolvedPrecision(param_dtype=param_dtype, reduce_dtype=DTYPES[config.reduce_dtype],
                                 fsdp=fsdp_enabled, loss_scaling=loss_scaling, reason=reason,
                                 static_loss_scale=config.loss_scaling == "static")
    _check_combination(config, resolved)
    return resolved


def _check_combination(cfg: Precision.Config, resolved: ResolvedPrecision) -> None:
    param_dtype = resolved.param_dtype
    if param_dtype == torch.float16 and cfg.loss_scaling == "none":
        logger.warning("precision.param_dtype=float16 with loss_scaling=none: small gradients underflow to zero "
                       "in float16; use loss_scaling=auto unless this is deliberate")
    if param_dtype != torch.float16 and cfg.loss_scaling in ("dynamic", "static"):
        logger.warning("precision.loss_scaling=%s with param_dtype=%s: loss scaling only matters for "
                       "float16, it is applied anyway", cfg.loss_scaling, _name(param_dtype))
    if not resolved.fsdp and cfg.reduce_dtype != "float32":
        logger.info("precision.reduce_dtype=%s has no effect without FSDP: gradients stay float32", cfg.reduce_dtype)
    if resolved.fsdp and not cfg.mixed_precision_eval and param_dtype != torch.float32:
        raise ValueError(
            f"precision.mixed_precision_eval=False (float32 evaluation) cannot be honoured with FSDP: FSDP casts "
            f"parameters to param_dtype={_name(param_dtype)} in every forward, evaluation included. "
            f"Set precision.mixed_precision_eval=True, or precision.param_dtype=float32"
        )


def _resolve_param_dtype(choice: str, device_type: str, cuda_available: bool) -> tuple[torch.dtype, str]:
    if choice != "auto":
        dtype = DTYPES[choice]
        if dtype == torch.bfloat16 and device_type == "cuda" and cuda_available and not _cuda_native_bf16():
            logger.warning("precision.param_dtype=bfloat16 on %s, which has no native bfloat16: it is emulated and "
                           "slow; consider float16 with loss scaling", torch.cuda.get_device_name())
        return dtype, f"precision.param_dtype={choice}"
    if device_type == "cpu":
        # Every CPU computes bfloat16 correctly, but without oneDNN's AVX-512 bfloat16 kernels the
        # matmuls fall back to a reference loop: on an AVX2-only CPU a bfloat16 llama3_debug step
        # measured ~50x slower than float32.
        if cpu_has_fast_bf16():
            return torch.bfloat16, "precision.param_dtype=auto: bfloat16 on CPU (oneDNN bfloat16 kernels available)"
        return torch.float32, ("precision.param_dtype=auto: float32, because this CPU has no oneDNN bfloat16 kernels "
                               "and bfloat16 matmuls would run many times slower than float32; set "
                               "precision.param_dtype=bfloat16 explicitly to test bfloat16 numerics anyway")
    if device_type == "cuda":
        if not cuda_available:
            return torch.bfloat16, ("precision.param_dtype=auto: bfloat16, assuming GPUs with native bfloat16 "
                                    "(Ampere or newer): this host has none to ask")
        name = torch.cuda.get_device_name()
        if _cuda_native_bf16():
            return torch.bfloat16, f"precision.param_dtype=auto: bfloat16 on {name}"
        return torch.float32, (f"precision.param_dtype=auto: float32, because {name} has no native bfloat16 "
                               "(compute capability < 8.0); set float16 explicitly for FP16 with loss scaling")
    return torch.float32, (f"precision.param_dtype=auto: float32, because bfloat16 support on device type "
                           f"'{device_type}' is not known here; set bfloat16 explicitly if the device supports it")


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (x86 AVX-512 BW/VL/DQ, or Arm BF16); without
    them bfloat16 matmuls run as reference loops."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def _cuda_native_bf16() -> bool:
    return torch.cuda.get_device_capability() >= (8, 0)


def _check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field_name}={value!r} is not one of: {', '.join(choices)}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
