"""Live FP8 health: per converted Linear, what its casts do to the tensors of one training micro-batch.

Every ``metrics.fp8_stats_freq`` steps, on that step's first micro-batch, for every FP8 / MX / blockwise
FP8 Linear (torchao ``Float8Linear``, ``MXFP8Linear``, this project's ``BlockwiseFP8Linear``):

- the amax of its input, weight and output gradient (the gradient includes an FP16 loss scale);
- per cast (``cast_health``): the share of elements it saturates and the share it flushes to zero;
- the SQNR of its output against the same Linear computed without FP8 from the same operands, in the
  dtype the FP8 GEMM writes (the precision policy's): 10*log10(||ref||^2 / ||ref - fp8||^2).

Routed experts converted by the moe_experts converter count as one layer per expert weight
(``<experts fqn>.w1`` ...), measured from inside their grouped GEMM: the token-grouped operands, the weight
with its per-expert scales, and the weight-gradient casts per token group (expert_stats.py).

How it stays free on the other steps: nothing is installed between stats steps. On a stats step,
hooks go onto the Linears for one forward + backward, and modules compiled with ``Module.compile`` run
their eager forward for that micro-batch, so the compiled graphs never see a hook (no recompile, no
graph break); every other micro-batch and step runs the compiled code untouched.

What the numbers cover with parallelism. Every operand is measured whole, as the cast sees it:
tensor-parallel DTensors are gathered (``full_tensor``) for the measurement, FSDP's weights are the
unsharded ones of the forward, and with FSDP float8 all-gather (the weight reaches the Linear already
in float8, or as blockwise FP8 blocks) the weight is measured from the sharded float32 master weights the
all-gather casts, gathered. Each data-parallel rank measures its own micro-batch; rank sums (elements, saturated,
underflowed, signal and noise energy) and maxima (amax) are reduced over the data-parallel group, so
shares and SQNR are those of the whole global micro-batch. With tensor parallelism and the tensorwise
recipe, torchao casts a Linear's input and output gradient to float8 inside the tensor-parallel
communication, before the Linear sees them: those casts (and the output SQNR, which needs the
high-precision input) are not measured and are logged once as such.
"""
from __future__ import annotations

import contextlib
import logging
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_lite.components.quantization.blockwise_linear import BlockwiseFP8Linear
from torchtitan_lite.components.quantization.cast_health import (
    OPERANDS,
    Cast,
    blockwise_casts,
    float8_casts,
    measure_cast,
    mx_casts,
    operand_amax,
    row_chunks,
    rows_per_chunk,
)
from torchtitan_lite.components.quantization.expert_stats import (
    converted_expert_gemms,
    expert_casts,
    measure_expert_cast,
)
from torchtitan_lite.components.quantization.fp8_stats_report import LayerHealth, sqnr_db
from torchtitan_lite.components.quantization.low_precision_linears import is_mx_linear, low_precision_linears
from torchtitan_lite.protocols.module_names import unwrapped_name

logger = logging.getLogger("torchtitan_lite")


class _Layer:
    """A converted Linear, or one expert weight's grouped GEMMs (``expert_weight``), and where its numbers
    accumulate during one stats micro-batch."""

    def __init__(self, index: int, fqn: str, module: nn.Module, casts: list[Cast], offset: int,
                 expert_weight: str | None = None) -> None:
        self.index, self.fqn, self.module, self.casts = index, fqn, module, casts
        self.expert_weight = expert_weight
        self.slots = {cast.name: offset + 3 * i for i, cast in enumerate(casts)}
        self.energy_slot = offset + 3 * len(casts)  # signal, noise
        self.width = 3 * len(casts) + 2
        self.measured: set[str] = set()  # operands measured on this step
        self.sqnr_measured = False
        self.forward_seen = False
        self.grad_seen = False
        self.sharded_weight: torch.Tensor | None = None


class Fp8StatsCollector:
    """Installs the stats hooks for one micro-batch, then reduces what they measured over the data-parallel
    group. Build it after the model is parallelized; every rank calls ``capture`` and ``collect`` on the
    same steps (``collect`` is collective)."""

    def __init__(self, model_parts: Sequence[nn.Module], *, freq: int,
                 dp_group: dist.ProcessGroup | None = None) -> None:
        if freq < 1:
            raise ValueError(f"Fp8StatsCollector needs freq >= 1, got {freq}")
        self.freq = freq
        self.dp_group = dp_group
        self.model_parts = list(model_parts)
        self.layers: list[_Layer] = []
        offset = 0
        for part in self.model_parts:
            for fqn, module in low_precision_linears(part):
                casts = _casts(module)
                layer = _Layer(len(self.layers), unwrapped_name(fqn), module, casts, offset)
                self.layers.append(layer)
                offset += layer.width
            for fqn, experts, name, mm in converted_expert_gemms(part):
                casts = expert_casts(mm.recipe, mm.power_of_2)
                layer = _Layer(len(self.layers), unwrapped_name(f"{fqn}.{name}"), experts, casts, offset,
                               expert_weight=name)
                self.layers.append(layer)
                offset += layer.width
        if not self.layers:
            raise ValueError("metrics.fp8_stats_freq > 0 but the model has no FP8 / MX Linear to measure (every "
                             "Linear was filtered or no converter is configured); set metrics.fp8_stats_freq=0 "
                             "or check the converter's plan with --print-fp8-plan")
        device = next(p.device for part in self.model_parts for p in part.parameters())
        self.device = torch.device("cpu") if device.type == "meta" else device
        self._sums = torch.zeros(offset, dtype=torch.float64, device=self.device)
        self._amax = torch.zeros(3 * len(self.layers), dtype=torch.float64, device=self.device)
        self._unmeasured_logged = False

    def due(self, step: int) -> bool:
        return step % self.freq == 0

    # ----------------------------------------------------------------------------------------------
    # Capture

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap the forward and backward of one micro-batch: every FP8 / MX Linear's and expert GEMM's casts are
        measured."""
        linears = [layer for layer in self.layers if layer.expert_weight is None]
        for layer in self.layers:
            layer.forward_seen = layer.grad_seen = layer.sqnr_measured = False
            layer.measured = set()
        for layer in linears:
            # Outside the forward FSDP holds the sharded parameter: with float8 all-gather this is the only
            # place the high-precision weight exists.
            layer.sharded_weight = typing.cast(torch.Tensor, layer.module.weight)
        handles = [layer.module.register_forward_hook(self._forward_hook(layer), prepend=True) for layer in linears]
        observed = self._observe_experts()
        with _eager(self.model_parts):
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()
                for observers, observer in observed:
                    observers.remove(observer)
                for layer in linears:
                    layer.sharded_weight = None

    def _observe_experts(self) -> list[tuple[list[Any], Any]]:
        """Attach an observer to every converted experts module's grouped GEMM; (its observer list, observer)."""
        by_module: dict[int, dict[str, _Layer]] = {}
        for layer in self.layers:
            if layer.expert_weight is not None:
                by_module.setdefault(id(layer.module), {})[layer.expert_weight] = layer
        observed = []
        for layers in by_module.values():
            module = next(iter(layers.values())).module
            observers = module.__dict__["grouped_mm"].observer
            observer = self._expert_observer(module, layers)
            observers.append(observer)
            observed.append((observers, observer))
        return observed

    def _expert_observer(self, module: nn.Module, layers: dict[str, _Layer]) -> Callable[..., None]:
        def observe(weight: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor,
                    output: torch.Tensor) -> None:
            # Which weight this GEMM multiplies by: the one sharing its storage (FSDP's unsharded parameter
            # during the forward, or the parameter itself).
            storage = weight.untyped_storage().data_ptr()
            layer = next((layers[name] for name in layers
                          if getattr(module, name).untyped_storage().data_ptr() == storage), None)
            if layer is None or layer.forward_seen:
                return  # not identifiable, or activation checkpointing's recomputation
            layer.forward_seen = True
            with _plain_math(output):
                self._measure_operand(layer, "weight", _whole(w_t), offsets)
                self._measure_operand(layer, "input", _whole(x), offsets)
                reference = torch._grouped_mm(x, w_t, offs=offsets).double()
                energies = torch.stack([reference.square().sum(), (reference - output.double()).square().sum()])
                self._sums[layer.energy_slot:layer.energy_slot + 2] += energies
                layer.sqnr_measured = True
            if output.requires_grad:
                output.register_hook(self._grad_hook(layer, offsets))
        return observe

    def _forward_hook(self, layer: _Layer) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            # Activation checkpointing runs the forward again in backward: measure the first pass only.
            if layer.forward_seen:
                return
            layer.forward_seen = True
            self._measure_forward(layer, args[0], output)
            if output.requires_grad:
                output.register_hook(self._grad_hook(layer))
        return hook

    def _grad_hook(self, layer: _Layer, offsets: torch.Tensor | None = None) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if layer.grad_seen:
                return
            layer.grad_seen = True
            with _plain_math(grad):
                self._measure_operand(layer, "grad_output", grad, offsets)
        return hook

    def _measure_forward(self, layer: _Layer, x: torch.Tensor, output: torch.Tensor) -> None:
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

        module = typing.cast(nn.Linear, layer.module)
        with _plain_math(output):
            weight: torch.Tensor = module.weight
            if (tensor_already_casted_to_fp8(weight) or _gathered_as_fp8_blocks(weight)) \
                    and layer.sharded_weight is not None:
                weight = layer.sharded_weight  # FSDP FP8 all-gather: measure the master weights it casts
            weight = _whole(weight)
            # The MX and the blockwise GEMMs read both operands in the dtype they write.
            if is_mx_linear(module) or isinstance(module, BlockwiseFP8Linear):
                weight = weight.to(output.dtype)
            self._measure_operand(layer, "weight", weight)
            if tensor_already_casted_to_fp8(x):
                return  # cast by tensor-parallel float8 communication before the Linear: not observable here
            # What the FP8 GEMM quantizes: the input in the dtype it computes in (the output's).
            x = _whole(x).to(output.dtype)
            self._measure_operand(layer, "input", x)
            bias = None if module.bias is None else _whole(module.bias).to(x.dtype)
            energies = _output_energies(x, weight.to(x.dtype), bias, _whole(output))
            self._sums[layer.energy_slot:layer.energy_slot + 2] += energies
            layer.sqnr_measured = True

    def _measure_operand(self, layer: _Layer, operand: str, x: torch.Tensor,
                         offsets: torch.Tensor | None = None) -> None:
        """``offsets``: the token groups of an expert GEMM's operands (None for a Linear)."""
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

        if tensor_already_casted_to_fp8(x):
            return  # tensor-parallel float8 communication cast it before the Linear
        x = _whole(x)
        x2d = x.reshape(-1, x.shape[-1])
        index = 3 * layer.index + OPERANDS.index(operand)
        self._amax[index] = torch.maximum(self._amax[index], operand_amax(x2d))
        for cast in layer.casts:
            if cast.operand == operand:
                slot = layer.slots[cast.name]
                self._sums[slot:slot + 3] += (measure_cast(cast, x2d) if offsets is None
                                              else measure_expert_cast(cast, x, offsets))
        layer.measured.add(operand)

    # ----------------------------------------------------------------------------------------------
    # Reduce

    def collect(self) -> list[LayerHealth]:
        """The captured step's numbers, summed (counts, energies) and maxed (amax) over data-parallel ranks;
        clears them for the next stats step. Collective over the data-parallel group."""
        sums, amax = self._sums, self._amax
        if self.dp_group is not None:
            dist.all_reduce(sums, group=self.dp_group)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.dp_group)
        sums_list, amax_list = sums.tolist(), amax.tolist()
        self._sums = torch.zeros_like(sums)
        self._amax = torch.zeros_like(amax)
        health = [self._layer_health(i, layer, sums_list, amax_list) for i, layer in enumerate(self.layers)]
        self._log_unmeasured()
        for layer in self.layers:
            layer.measured, layer.sqnr_measured = set(), False
            layer.forward_seen = layer.grad_seen = False
        return health

    def _layer_health(self, i: int, layer: _Layer, sums: list[float], amax: list[float]) -> LayerHealth:
        health = LayerHealth(layer.fqn, casts={cast.name: cast.describe() for cast in layer.casts})
        for j, operand in enumerate(OPERANDS):
            if operand in layer.measured:
                health.amax[operand] = amax[3 * i + j]
        for cast in layer.casts:
            if cast.operand not in layer.measured:
                continue
            elements, saturated, underflowed = sums[layer.slots[cast.name]:layer.slots[cast.name] + 3]
            health.saturated[cast.name] = saturated / elements if elements else 0.0
            health.underflow[cast.name] = underflowed / elements if elements else 0.0
        if layer.sqnr_measured:
            health.output_sqnr_db = sqnr_db(*sums[layer.energy_slot:layer.energy_slot + 2])
        return health

    def _log_unmeasured(self) -> None:
        if not any(layer.forward_seen for layer in self.layers):
            return  # nothing was captured since the last collect
        missing = [f"{layer.fqn} ({', '.join(o for o in OPERANDS if o not in layer.measured)})"
                   for layer in self.layers if len(layer.measured) < len(OPERANDS)]
        if missing and not self._unmeasured_logged:
            self._unmeasured_logged = True
            logger.info("fp8 stats: %d Linear(s) receive some operands already in float8 (tensor-parallel float8 "
                        "communication casts them before the Linear), not measured: %s", len(missing),
                        ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _casts(module: nn.Module) -> list[Cast]:
    if is_mx_linear(module):
        return mx_casts(module)
    if isinstance(module, BlockwiseFP8Linear):
        return blockwise_casts(module)
    return float8_casts(module.config)


def _output_energies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     fp8_output: torch.Tensor) -> torch.Tensor:
    """float64 [signal, noise]: ||ref||^2 and ||ref - fp8||^2 with ref = F.linear(x, weight, bias), computed
    in row chunks so the reference never exists whole."""
    x2d, out2d = x.reshape(-1, x.shape[-1]), fp8_output.reshape(-1, fp8_output.shape[-1])
    energies = torch.zeros(2, dtype=torch.float64, device=x.device)
    rows = rows_per_chunk(out2d)
    for start, x_rows in zip(range(0, x2d.shape[0], rows), row_chunks(x2d, rows)):
        reference = F.linear(x_rows, weight, bias).double()
        energies[0] += reference.square().sum()
        energies[1] += (reference - out2d[start:start + rows].double()).square().sum()
    return energies


# --------------------------------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def _eager(model_parts: Sequence[nn.Module]) -> Iterator[None]:
    """Modules compiled with ``Module.compile`` run their eager forward inside (the compiled one is kept)."""
    compiled = [(m, m._compiled_call_impl) for part in model_parts for m in part.modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    for module, _ in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, impl in compiled:
            module._compiled_call_impl = impl


@contextlib.contextmanager
def _plain_math(like: torch.Tensor) -> Iterator[None]:
    """No autograd graph and no autocast around the measurement: dtypes are chosen explicitly."""
    device_type = like.device.type
    with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):
        yield


def _gathered_as_fp8_blocks(weight: torch.Tensor) -> bool:
    """The weight reached the Linear as blockwise FP8 blocks (E4M3 ``_data`` and ``_scale``), from FSDP's
    blockwise FP8 all-gather: its values are already quantized, so the casts are measured on the master weights."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return hasattr(local, "_data") and hasattr(local, "_scale")


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding all of ``t``: DTensors are gathered; the float8 all-gather weight wrapper is
    unwrapped to the float32 master shard first."""
    if not isinstance(t, DTensor):
        return getattr(t, "_tensor", t)  # WeightWithDynamicFloat8CastTensor without a DTensor around it
    local = t.to_local()
    inner = getattr(local, "_tensor", None)
    if inner is not None:
        t = DTensor.from_local(inner, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()
