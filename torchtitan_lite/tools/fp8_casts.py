"""The FP8 cast points of every recipe this project trains with, in one place: a numerics probe watches them
(fp8_gates.py) and a planted fault changes them (fp8_faults.py).

Every recipe ends each cast in one of four functions, looked up in its module at call time (so a module
attribute replaced here is the one the recipe calls):

- ``torchao.float8.float8_training_tensor.to_fp8_saturated(scaled, dtype)``: torchao's Float8Linear
  (tensorwise, rowwise, rowwise_with_gw_hp);
- ``torchao.float8.float8_utils.to_fp8_saturated(scaled, dtype)``: the rowwise experts (grouped_gemm.fp8_scaled);
- ``blockwise_fp8.to_e4m3_saturated(x, scale)``: blockwise Linears and blockwise experts;
- ``torchao.prototype.mx_formats.mx_tensor.to_mx(x, dtype, block, mode)``: MXFP8 Linears and MXFP8 experts.

``rounded_casts(rounding)`` routes all four through one ``rounding(scaled, dtype)`` (the float32 values already
multiplied by their scales, before saturation), and ``observed_casts(record)`` shows each cast's scaled values
and its FP8 result to ``record``. ``gemm_phases()`` marks which GEMM pass a cast belongs to (``phase()``: forward
or backward) and which operand is the output gradient (``is_gradient``), by wrapping the autograd functions that
run the recipes' GEMMs.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

Rounding = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
"""float32 values already multiplied by their scales -> their FP8 tensor of ``dtype``."""
Record = Callable[[torch.Tensor, torch.Tensor], None]
"""Called with (scaled float32 values, their FP8 cast) for every cast."""

TORCHAO_FLOAT8_CAST = ("torchao.float8.float8_training_tensor", "to_fp8_saturated")
TORCHAO_UTILS_CAST = ("torchao.float8.float8_utils", "to_fp8_saturated")
BLOCKWISE_CAST = ("torchtitan_lite.components.quantization.blockwise_fp8", "to_e4m3_saturated")
MX_CAST = ("torchao.prototype.mx_formats.mx_tensor", "to_mx")

GEMM_FUNCTIONS = (
    ("torchao.float8.float8_linear", "matmul_with_hp_or_float8_args"),
    ("torchao.prototype.moe_training.mxfp8_linear", "mx_mm"),
    ("torchtitan_lite.components.quantization.blockwise_fp8", "_EmulatedBlockwiseMatmul"),
    ("torchtitan_lite.components.quantization.blockwise_fp8", "_EmulatedPrequantizedMatmul"),
    ("torchtitan_lite.components.quantization.grouped_gemm", "EmulatedGroupedMM"),
)
"""The autograd functions whose forward and backward run the recipes' GEMMs and casts."""

_PHASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("fp8_gemm_phase", default=None)
_GRADIENT: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("fp8_output_gradient", default=None)


@contextlib.contextmanager
def patched(module_name: str, attribute: str, value: Any) -> Iterator[Any]:
    """``module.attribute = value`` inside the block, the original restored after it; yields the original."""
    module = importlib.import_module(module_name)
    original = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
        yield original
    finally:
        setattr(module, attribute, original)


# --------------------------------------------------------------------------------------------------
# Roundings


def saturating(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every recipe's own rounding: clamp to the format's largest finite value, round to nearest even."""
    top = torch.finfo(dtype).max
    return scaled.clamp(-top, top).to(dtype)


@contextlib.contextmanager
def rounded_casts(rounding: Rounding) -> Iterator[None]:
    """Every recipe's final cast (the four cast points) done by ``rounding``; scales are unchanged."""
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(*TORCHAO_FLOAT8_CAST, lambda x, dtype: rounding(x.float(), dtype)))
        stack.enter_context(patched(*TORCHAO_UTILS_CAST, lambda x, dtype: rounding(x.float(), dtype)))
        e4m3 = torch.float8_e4m3fn
        stack.enter_context(patched(*BLOCKWISE_CAST, lambda x, scale: rounding(x.to(torch.float32) * scale, e4m3)))
        to_mx = importlib.import_module(MX_CAST[0]).to_mx

        def mx(data_hp: torch.Tensor, elem_dtype: Any, block_size: int, *args: Any, **kwargs: Any) -> Any:
            scale, data = to_mx(data_hp, elem_dtype, block_size, *args, **kwargs)
            blocks = data_hp.to(torch.float32).reshape(*data_hp.shape[:-1], -1, block_size)
            scaled = blocks / get_fp_scale(scale).reshape(*blocks.shape[:-1], 1)
            return scale, rounding(scaled, data.dtype).reshape(data.shape)

        stack.enter_context(patched(*MX_CAST, mx))
        yield


@contextlib.contextmanager
def observed_casts(record: Record) -> Iterator[None]:
    """``record(scaled, fp8)`` for every cast of every recipe, as the cast points currently do it (a fault
    installed before this is what is observed)."""
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale

    with contextlib.ExitStack() as stack:
        def float8_point(point: tuple[str, str]) -> None:
            inner = getattr(importlib.import_module(point[0]), point[1])

            def observed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
                out = inner(x, dtype)
                record(x.float(), out)
                return out

            stack.enter_context(patched(*point, observed))

        float8_point(TORCHAO_FLOAT8_CAST)
        float8_point(TORCHAO_UTILS_CAST)
        blockwise = getattr(importlib.import_module(BLOCKWISE_CAST[0]), BLOCKWISE_CAST[1])

        def observed_blockwise(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            out = blockwise(x, scale)
            record(x.to(torch.float32) * scale, out)
            return out

        stack.enter_context(patched(*BLOCKWISE_CAST, observed_blockwise))
        to_mx = getattr(importlib.import_module(MX_CAST[0]), MX_CAST[1])

        def observed_mx(data_hp: torch.Tensor, elem_dtype: Any, block_size: int, *args: Any, **kwargs: Any) -> Any:
            scale, data = to_mx(data_hp, elem_dtype, block_size, *args, **kwargs)
            blocks = data_hp.to(torch.float32).reshape(*data_hp.shape[:-1], -1, block_size)
            record((blocks / get_fp_scale(scale).reshape(*blocks.shape[:-1], 1)).reshape(data.shape), data)
            return scale, data

        stack.enter_context(patched(*MX_CAST, observed_mx))
        yield


# --------------------------------------------------------------------------------------------------
# Which GEMM pass, which operand


def phase() -> str | None:
    """'forward' or 'backward' inside one of the recipes' GEMM functions (``gemm_phases``), else None."""
    return _PHASE.get()


def is_gradient(t: torch.Tensor) -> bool:
    """Whether ``t`` is the output gradient of the backward pass running now (a view of it, or a transposed
    copy: the weight-gradient GEMM casts the gradient down its columns)."""
    grad = _GRADIENT.get()
    if grad is None or t.dim() != 2:
        return False
    if t.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        return True
    return t.shape == grad.t().shape and bool(torch.equal(t, grad.t()))


@contextlib.contextmanager
def gemm_phases() -> Iterator[None]:
    """``phase()`` and ``is_gradient`` answer inside the recipes' GEMM functions (GEMM_FUNCTIONS)."""
    with contextlib.ExitStack() as stack:
        for module_name, name in GEMM_FUNCTIONS:
            cls = getattr(importlib.import_module(module_name), name)
            stack.enter_context(_wrapped_passes(cls))
        yield


@contextlib.contextmanager
def _wrapped_passes(cls: type) -> Iterator[None]:
    forward, backward = cls.__dict__["forward"], cls.__dict__["backward"]

    def run_forward(ctx: Any, *args: Any) -> Any:
        token = _PHASE.set("forward")
        try:
            return forward.__func__(ctx, *args)
        finally:
            _PHASE.reset(token)

    def run_backward(ctx: Any, grad: torch.Tensor, *rest: Any) -> Any:
        # Contiguous here so that the function's own .contiguous() keeps the storage is_gradient recognises.
        grad = grad.contiguous()
        tokens = _PHASE.set("backward"), _GRADIENT.set(grad.reshape(-1, grad.shape[-1]))
        try:
            return backward.__func__(ctx, grad, *rest)
        finally:
            _GRADIENT.reset(tokens[1])
            _PHASE.reset(tokens[0])

    cls.forward, cls.backward = staticmethod(run_forward), staticmethod(run_backward)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        cls.forward, cls.backward = forward, backward  # type: ignore[attr-defined]
