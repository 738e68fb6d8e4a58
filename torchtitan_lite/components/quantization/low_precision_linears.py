"""The Linears a converter swapped for a low-precision (FP8 / MX / blockwise FP8) twin, and running them in
high precision.

torchao's ``Float8Linear``, its MX counterpart ``MXFP8Linear`` and this project's ``BlockwiseFP8Linear`` are
``nn.Linear`` subclasses that keep the high-precision weight and quantize inside ``forward``.
``high_precision_linears`` runs them with ``nn.Linear.forward`` instead (what the unconverted model computes
from the same weights, in the precision policy's dtype), e.g. for validation in the high-precision policy.
"""
from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterable, Iterator

import torch.nn as nn

# Imported only by a run that converts to MX; a model cannot hold an MXFP8Linear before it is.
_MX_LINEAR_MODULE = "torchao.prototype.moe_training.mxfp8_linear"


def low_precision_linear_types() -> tuple[type[nn.Linear], ...]:
    """The low-precision Linear classes that can be in a model now (MX only once imported)."""
    from torchao.float8.float8_linear import Float8Linear

    from torchtitan_lite.components.quantization.blockwise_linear import BlockwiseFP8Linear

    types_: list[type[nn.Linear]] = [Float8Linear, BlockwiseFP8Linear]
    mx = sys.modules.get(_MX_LINEAR_MODULE)
    if mx is not None:
        types_.append(mx.MXFP8Linear)
    return tuple(types_)


def low_precision_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(fqn, module) of every FP8 / MX / blockwise FP8 Linear of ``model``, in module order."""
    kinds = low_precision_linear_types()
    return [(fqn, module) for fqn, module in model.named_modules() if isinstance(module, kinds)]


def is_mx_linear(module: nn.Module) -> bool:
    mx = sys.modules.get(_MX_LINEAR_MODULE)
    return mx is not None and isinstance(module, mx.MXFP8Linear)


@contextlib.contextmanager
def high_precision_linears(model_parts: Iterable[nn.Module]) -> Iterator[int]:
    """Inside, every FP8 / MX Linear computes ``nn.Linear.forward`` (F.linear on its own weight, so autocast
    or FSDP's parameter casts decide the dtype) and every converted experts module its high-precision grouped
    GEMM; yields how many modules were switched. Restored on exit."""
    from torchtitan_lite.components.quantization.grouped_gemm import QuantizedGroupedMM

    parts = list(model_parts)
    switched = [module for part in parts for _, module in low_precision_linears(part)]
    # Routed experts (moe_experts converter): their quantized grouped GEMM is an instance attribute shadowing
    # the class's high-precision one; taking it away for the block runs the experts in the compute dtype.
    experts = [(experts_module, vars(experts_module).pop("grouped_mm")) for part in parts
               for experts_module in part.modules()
               if isinstance(vars(experts_module).get("grouped_mm"), QuantizedGroupedMM)]
    for module in switched:
        # An instance attribute shadows the class's forward; deleting it restores the FP8 / MX one.
        module.forward = types.MethodType(nn.Linear.forward, module)  # type: ignore[method-assign]
    try:
        yield len(switched) + len(experts)
    finally:
        for module in switched:
            del module.forward
        for experts_module, grouped_mm in experts:
            vars(experts_module)["grouped_mm"] = grouped_mm
