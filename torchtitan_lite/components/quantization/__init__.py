"""Quantized-training converters; importing this package registers their kinds."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.float8_plan import format_plan_summary
from torchtitan_lite.components.quantization.linear_quantizer import LinearQuantizer
from torchtitan_lite.components.quantization.mx import MXLinearConverter
from torchtitan_lite.protocols.model_converter import ModelConverter

__all__ = ["Float8BlockwiseConverter", "Float8LinearConverter", "LinearQuantizer", "MXLinearConverter", "fp8_plan_summary",
           "linear_quantizer"]


def linear_quantizer(converters: Sequence[ModelConverter]) -> LinearQuantizer | None:
    """The run's converter that trains Linears in low precision (float8, MX), or None. There is at most one:
    two converters that swap nn.Linear are refused by the container."""
    found = [c for c in converters if isinstance(c, LinearQuantizer)]
    return found[0] if found else None


def fp8_plan_summary(converters: Sequence[ModelConverter], model: nn.Module) -> str | None:
    """What the run's FP8 converter did to ``model`` (after ``convert``) in a few lines for the launch log, or
    None without one. The full table is --print-fp8-plan's (and --dry-run's)."""
    quantizer = linear_quantizer(converters)
    if quantizer is None or quantizer.plan is None:
        return None
    seq_len = quantizer.context.seq_len
    flops_fn = getattr(model, "flops_per_token", None)
    total = flops_fn(seq_len) if callable(flops_fn) else None
    return (f"{quantizer.kind} converter ({quantizer.plan_config.recipe_name}): "
            + format_plan_summary(quantizer.plan, seq_len=seq_len, total_flops_per_token=total))
