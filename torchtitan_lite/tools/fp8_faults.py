"""Planted FP8 faults: realistic bugs of an FP8 recipe, each installable into a converted model for a while, so
that a check of the recipes can show it fails on them (scripts/fp8_sqnr.py --check --fault NAME).

    with plant("round_toward_zero", model):
        ...  # every FP8 cast of the model's recipe rounds toward zero here
    # and rounds to nearest again here

A fault is selected by name from a tool's command line (``FAULTS``), never from a training config: no
config field reaches this module. ``Fault.applies_to`` names the recipes (fp8_gates.RECIPES) a fault changes;
``Fault.not_applicable`` says for each other recipe why the bug cannot occur there.

Faults change module attributes of torchao and of this project's emulations (fp8_casts.py lists the cast
points), process-wide while installed; ``model`` gives the faults that keep per-module state (a stale amax)
their modules. Installed faults do not nest with one another.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_lite.tools.fp8_casts import gemm_phases, is_gradient, patched, phase, rounded_casts, saturating

FLOAT8_LINEAR = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BLOCKWISE = ("blockwise", "blockwise_pow2")
EXPERTS_BLOCKWISE = ("experts_blockwise", "experts_blockwise_pow2")
ALL_RECIPES = (*FLOAT8_LINEAR, "mxfp8", *BLOCKWISE, "experts_rowwise", "experts_mxfp8", *EXPERTS_BLOCKWISE)
"""The recipes fp8_gates.py checks (kept equal to fp8_gates.RECIPES by a test)."""

_TORCHAO_DYNAMIC = ("torchao.float8.float8_linear", "hp_tensor_to_float8_dynamic")
"""Where torchao's Float8Linear computes each operand's scale and casts it (role, axis and dtype as arguments)."""
_GROUPED = "torchtitan_lite.components.quantization.grouped_gemm"
_BLOCKWISE = "torchtitan_lite.components.quantization.blockwise_fp8"


@dataclass(frozen=True)
class Fault:
    name: str
    bug: str
    """What goes wrong, as it would in a kernel or a recipe's code."""
    applies_to: tuple[str, ...]
    not_applicable: dict[str, str]
    """Every other recipe: why the bug cannot occur there."""
    install: Callable[[nn.Module], contextlib.AbstractContextManager[None]]


# --------------------------------------------------------------------------------------------------
# Roundings


def round_toward_zero(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scaled`` saturated, then rounded to the FP8 neighbour nearer zero (truncation) instead of the nearest."""
    nearest = saturating(scaled, dtype)
    # One step toward zero where rounding went away from it: FP8 bit patterns order magnitudes, and the sign
    # bit is the top one, so subtracting 1 from a nonzero pattern moves one value toward zero.
    away = nearest.float().abs() > scaled.abs().clamp(max=torch.finfo(dtype).max)
    return (nearest.view(torch.uint8) - away.to(torch.uint8)).view(dtype)


def non_saturating(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The OCP non-saturating conversion: beyond the largest finite value, NaN (e4m3fn has no infinity) or
    +-inf (e5m2), whatever this CPU's own cast does with such values."""
    top = torch.finfo(dtype).max
    beyond = scaled.abs() > top
    out = scaled.clamp(-top, top).to(dtype).float()
    overflow = torch.full_like(out, float("nan")) if dtype == torch.float8_e4m3fn else torch.copysign(
        torch.full_like(out, float("inf")), scaled)
    return torch.where(beyond, overflow, out).to(dtype)


def unscaled(t: torch.Tensor) -> torch.Tensor:
    """``t`` cast to e4m3 with scale 1 (saturating), back in float32."""
    return saturating(t.float(), torch.float8_e4m3fn).float()


# --------------------------------------------------------------------------------------------------
# The faults


@contextlib.contextmanager
def _round_toward_zero(_model: nn.Module) -> Iterator[None]:
    with rounded_casts(round_toward_zero):
        yield


@contextlib.contextmanager
def _e5m2_forward(_model: nn.Module) -> Iterator[None]:
    def rounding(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if phase() != "forward":
            return saturating(scaled, dtype)
        # e5m2's values within e4m3's range are e4m3 values too: stored in the dtype the GEMM expects (torchao's
        # MX tensors insist on it), they carry e5m2's precision.
        return saturating(saturating(scaled, torch.float8_e5m2).float(), dtype)

    with gemm_phases(), rounded_casts(rounding):
        yield


@contextlib.contextmanager
def _stale_amax(_model: nn.Module) -> Iterator[None]:
    """Each Float8Linear cast scaled by the amax its cast site saw on the previous step, cast without clamping."""
    from torchao.float8.float8_scaling_utils import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    history: dict[tuple[Any, ...], torch.Tensor] = {}

    def stale(hp: torch.Tensor, dtype: torch.dtype, mm_config: Any, reduce_amax: bool = False,
              gemm_input_role: Any = None, device_mesh: Any = None, scaling_granularity: Any = None,
              axiswise_dim: int | None = None, round_scales_to_power_of_2: bool = False) -> Any:
        amax = tensor_to_amax(hp, reduce_amax, device_mesh, scaling_granularity, axiswise_dim)
        # The cast site: the Linear (its own LinearMMConfig object), the operand's role, axis, format and shape.
        key = (id(mm_config), gemm_input_role, axiswise_dim, dtype, tuple(hp.shape))
        previous = history.get(key, amax)  # the first step has no history: its own amax, as delayed scaling starts
        history[key] = amax
        scale = amax_to_scale(previous, dtype, round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(hp, scale, dtype, mm_config, gemm_input_role, axiswise_dim)

    with patched(*_TORCHAO_DYNAMIC, stale), rounded_casts(non_saturating):
        yield


@contextlib.contextmanager
def _unscaled_gradient_casts(_model: nn.Module) -> Iterator[None]:
    """The output gradient cast with scale 1 (no amax scaling) in every GEMM that reads it."""
    from torchao.float8.float8_scaling_utils import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_training_tensor import GemmInputRole
    from torchao.float8.float8_utils import tensor_to_scale

    def torchao_cast(original: Callable[..., Any]) -> Callable[..., Any]:
        def cast(hp: torch.Tensor, dtype: torch.dtype, mm_config: Any, reduce_amax: bool = False,
                 gemm_input_role: Any = None, device_mesh: Any = None, scaling_granularity: Any = None,
                 axiswise_dim: int | None = None, round_scales_to_power_of_2: bool = False) -> Any:
            if gemm_input_role is not GemmInputRole.GRAD_OUTPUT:
                return original(hp, dtype, mm_config, reduce_amax, gemm_input_role, device_mesh, scaling_granularity,
                                axiswise_dim, round_scales_to_power_of_2)
            scale = torch.ones_like(tensor_to_scale(hp, dtype, reduce_amax, device_mesh, scaling_granularity,
                                                    axiswise_dim, round_scales_to_power_of_2))
            return hp_tensor_and_scale_to_float8(hp, scale, dtype, mm_config, gemm_input_role, axiswise_dim)
        return cast

    blockwise = importlib.import_module(_BLOCKWISE)
    tiles_1x128 = blockwise._tiles_1x128

    def blockwise_tiles(x: torch.Tensor, *, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not is_gradient(x):
            return tiles_1x128(x, power_of_2=power_of_2)
        tiles = F.pad(x, (0, -x.shape[1] % blockwise.BLOCK)).reshape(x.shape[0], -1, blockwise.BLOCK)
        scale = torch.ones(tiles.shape[:2], dtype=torch.float32, device=x.device)
        return blockwise.to_e4m3_saturated(tiles, scale.unsqueeze(-1)), scale

    to_mx = importlib.import_module("torchao.prototype.mx_formats.mx_tensor").to_mx

    def mx(data_hp: torch.Tensor, elem_dtype: Any, block_size: int, *args: Any, **kwargs: Any) -> Any:
        scale, data = to_mx(data_hp, elem_dtype, block_size, *args, **kwargs)
        if not is_gradient(data_hp):
            return scale, data
        one = torch.ones(scale.shape, device=scale.device).to(scale.dtype)  # e8m0 2^0
        return one, saturating(data_hp.float(), data.dtype)

    rowwise = _grouped_rowwise_tiles()
    grouped_unscaled = dataclasses.replace(
        rowwise, grad_output=unscaled,
        weight_grad_operand=lambda t, group, n: unscaled(t) if is_gradient(t) else rowwise.weight_grad_operand(
            t, group, n))
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(*_TORCHAO_DYNAMIC, torchao_cast(_torchao_dynamic())))
        stack.enter_context(patched(_BLOCKWISE, "_tiles_1x128", blockwise_tiles))
        stack.enter_context(patched("torchao.prototype.mx_formats.mx_tensor", "to_mx", mx))
        stack.enter_context(_grouped_rowwise(grouped_unscaled))
        stack.enter_context(gemm_phases())
        yield


@contextlib.contextmanager
def _wrong_axis(_model: nn.Module) -> Iterator[None]:
    """Rowwise scales from the amax along the other axis of each operand (per column where the GEMM needs one per
    row, and the reverse). The values are quantized with those scales and then handed to the recipe's own cast, so
    the GEMM runs as before but with the precision the wrong-axis scales left."""
    from torchao.float8.config import ScalingGranularity

    from torchtitan_lite.components.quantization.grouped_gemm import fp8_rowwise

    def torchao_cast(original: Callable[..., Any]) -> Callable[..., Any]:
        def cast(hp: torch.Tensor, dtype: torch.dtype, mm_config: Any, reduce_amax: bool = False,
                 gemm_input_role: Any = None, device_mesh: Any = None, scaling_granularity: Any = None,
                 axiswise_dim: int | None = None, round_scales_to_power_of_2: bool = False) -> Any:
            if scaling_granularity is ScalingGranularity.AXISWISE and axiswise_dim is not None:
                other = 0 if axiswise_dim in (-1, hp.dim() - 1) else -1
                hp = _fake_cast(hp, dtype, other, round_scales_to_power_of_2)
            return original(hp, dtype, mm_config, reduce_amax, gemm_input_role, device_mesh, scaling_granularity,
                            axiswise_dim, round_scales_to_power_of_2)
        return cast

    grouped = dataclasses.replace(
        _grouped_rowwise_tiles(),
        forward_input=lambda x: fp8_rowwise(x, 0), forward_weight=lambda w_t: fp8_rowwise(w_t, -1),
        grad_output=lambda g: fp8_rowwise(g, 0), grad_input_weight=lambda w_t: fp8_rowwise(w_t, -2),
        weight_grad_operand=lambda t, _group, _n: fp8_rowwise(t, -1))
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(*_TORCHAO_DYNAMIC, torchao_cast(_torchao_dynamic())))
        stack.enter_context(_grouped_rowwise(grouped))
        yield


def _fake_cast(hp: torch.Tensor, dtype: torch.dtype, dim: int, power_of_2: bool) -> torch.Tensor:
    """``hp`` cast with one scale per slice along ``dim`` and back, in its own dtype."""
    from torchao.float8.float8_utils import amax_to_scale

    scale = amax_to_scale(hp.abs().amax(dim=dim, keepdim=True).float(), dtype, power_of_2)
    return (saturating(hp.float() * scale, dtype).float() / scale).to(hp.dtype)


@contextlib.contextmanager
def _tiles_1x64(_model: nn.Module) -> Iterator[None]:
    """Activation and gradient tiles quantized 64 wide while the GEMM reads their scales as 1x128 tiles' (it
    takes the scale buffer's first rows x ceil(cols / 128) entries in memory order)."""
    blockwise = importlib.import_module(_BLOCKWISE)

    def tiles(x: torch.Tensor, *, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        half = blockwise.BLOCK // 2
        padded = F.pad(x, (0, -cols % blockwise.BLOCK))
        small = padded.reshape(rows, -1, half)
        scale64 = blockwise.tile_scales(small.abs().amax(dim=-1), power_of_2=power_of_2)
        data = blockwise.to_e4m3_saturated(small, scale64.unsqueeze(-1)).reshape(rows, -1, blockwise.BLOCK)
        return data, scale64.reshape(-1)[:rows * data.shape[1]].reshape(rows, data.shape[1])

    with patched(_BLOCKWISE, "_tiles_1x128", tiles):
        yield


@contextlib.contextmanager
def _shared_expert_scale(_model: nn.Module) -> Iterator[None]:
    """The rowwise experts' per-expert scales (each expert weight's columns, each token group's columns in the
    weight gradient) replaced by one shared by all experts: the amax over every expert."""
    from torchao.float8.float8_utils import amax_to_scale

    from torchtitan_lite.components.quantization.grouped_gemm import E4M3, fp8_rowwise, fp8_scaled

    def shared(w_t: torch.Tensor, dims: tuple[int, int]) -> torch.Tensor:
        # The recipe's amax along one dim of each expert, taken over the experts (dim 0) as well.
        scale = amax_to_scale(w_t.abs().amax(dim=dims, keepdim=True).float(), E4M3, round_scales_to_power_of_2=True)
        return fp8_scaled(w_t, scale)

    grouped = dataclasses.replace(
        _grouped_rowwise_tiles(), forward_weight=lambda w_t: shared(w_t, (0, -2)),
        grad_input_weight=lambda w_t: shared(w_t, (0, -1)),
        weight_grad_operand=lambda t, _group, _n: fp8_rowwise(t, 0))
    with _grouped_rowwise(grouped):
        yield


def _torchao_dynamic() -> Callable[..., Any]:
    return getattr(importlib.import_module(_TORCHAO_DYNAMIC[0]), _TORCHAO_DYNAMIC[1])


def _grouped_rowwise_tiles() -> Any:
    return importlib.import_module(_GROUPED).TILES["rowwise"]


@contextlib.contextmanager
def _grouped_rowwise(tiles: Any) -> Iterator[None]:
    table = importlib.import_module(_GROUPED).TILES
    original = table["rowwise"]
    table["rowwise"] = tiles
    try:
        yield
    finally:
        table["rowwise"] = original


def _others(applies_to: tuple[str, ...], why: dict[str, str]) -> dict[str, str]:
    """``why`` for every recipe outside ``applies_to``: a recipe key, or a group key matched by prefix."""
    result = {}
    for recipe in ALL_RECIPES:
        if recipe in applies_to:
            continue
        reason = why.get(recipe) or next((text for key, text in why.items() if recipe.startswith(key)), None)
        if reason is None:
            raise ValueError(f"no reason given why the fault does not apply to {recipe}")
        result[recipe] = reason
    return result


_NO_HISTORY = ("its scales are computed by the cast itself from the very tile, block or rows it casts (no amax is "
               "carried from step to step)")
_NO_EXPERT_SCALE = "it scales within one expert's weight or token group only"

FAULTS: dict[str, Fault] = {fault.name: fault for fault in (
    Fault("round_toward_zero", "every FP8 cast truncates (rounds toward zero) instead of rounding to nearest even",
          ALL_RECIPES, {}, _round_toward_zero),
    Fault("stale_amax", "each cast is scaled by the amax its cast site saw one step earlier (delayed scaling) and "
                        "cast without saturating: what grew since overflows to NaN / inf",
          FLOAT8_LINEAR, _others(FLOAT8_LINEAR, {"mxfp8": _NO_HISTORY, "blockwise": _NO_HISTORY,
                                                 "experts": _NO_HISTORY}), _stale_amax),
    Fault("unscaled_gradient_casts", "the output gradient is cast to FP8 with scale 1 (no amax scaling), where "
                                     "real gradients (~1e-6) lie below FP8's smallest values",
          ALL_RECIPES, {}, _unscaled_gradient_casts),
    Fault("e5m2_forward", "the forward GEMM's input and weight are cast to e5m2 (2 mantissa bits) instead of "
                          "e4m3 (3)", ALL_RECIPES, {}, _e5m2_forward),
    Fault("wrong_axis", "rowwise scales come from the amax along the operand's other axis (per column where the "
                        "GEMM needs per row, and the reverse)",
          ("rowwise", "rowwise_with_gw_hp", "experts_rowwise"),
          _others(("rowwise", "rowwise_with_gw_hp", "experts_rowwise"), {
              "tensorwise": "one scale per tensor has no axis",
              "mxfp8": "MX blocks of 32 run along the GEMM's reduction dim by construction (to_mx per block)",
              "blockwise": "tiles and blocks have their own fault (tiles_1x64)",
              "experts_mxfp8": "MX blocks of 32 run along the GEMM's reduction dim by construction",
              "experts_blockwise": "tiles and blocks have their own fault (tiles_1x64)"}), _wrong_axis),
    Fault("tiles_1x64", "activation and gradient tiles are quantized 64 wide, and the GEMM reads their scales as "
                        "1x128 tiles' (the first entries of the scale buffer)",
          (*BLOCKWISE, *EXPERTS_BLOCKWISE),
          _others((*BLOCKWISE, *EXPERTS_BLOCKWISE), {
              "tensorwise": "it has no tiles", "rowwise": "it has no tiles", "mxfp8": "it has no 1x128 tiles",
              "experts_rowwise": "it has no tiles", "experts_mxfp8": "it has no 1x128 tiles"}), _tiles_1x64),
    Fault("shared_expert_scale", "one scale shared by all experts where the rowwise experts scale each expert's "
                                 "weight columns and each token group's gradient columns on their own",
          ("experts_rowwise",), _others(("experts_rowwise",), {
              "experts_mxfp8": _NO_EXPERT_SCALE, "experts_blockwise": _NO_EXPERT_SCALE,
              "": "it has no experts"}), _shared_expert_scale),
)}


def plant(name: str, model: nn.Module | None = None) -> contextlib.AbstractContextManager[None]:
    """Fault ``name`` installed (into ``model`` where given, else process-wide, which is what every fault does
    today) for the ``with`` block; ValueError naming the faults otherwise."""
    if name not in FAULTS:
        raise ValueError(f"unknown planted fault {name!r}; choose one of: {', '.join(FAULTS)}")
    return FAULTS[name].install(model if model is not None else nn.Module())
