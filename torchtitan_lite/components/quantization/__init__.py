"""Quantized-training converters; importing this package registers their kinds."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.float8_plan import format_plan_summary
from torchtitan_lite.components.quantization.linear_quantizer import LinearQuantizer
from torchtitan_lite.components.quantization.moe_experts import GroupedExpertsConverter
from torchtitan_lite.components.quantization.mx import MXLinearConverter
from torchtitan_lite.protocols.model_converter import ModelConverter

__all__ = ["Float8BlockwiseConverter", "Float8LinearConverter", "GroupedExpertsConverter", "LinearQuantizer",
           "MXLinearConverter", "expert_quantizer", "fp8_plan_summary", "linear_quantizer", "low_precision_plan"]


def linear_quantizer(converters: Sequence[ModelConverter]) -> LinearQuantizer | None:
    """The run's converter that trains Linears in low precision (float8, MX), or None. There is at most one:
    two converters that swap nn.Linear are refused by the container."""
    found = [c for c in converters if isinstance(c, LinearQuantizer)]
    return found[0] if found else None


def expert_quantizer(converters: Sequence[ModelConverter]) -> GroupedExpertsConverter | None:
    """The run's converter that trains routed experts in low precision (moe_experts), or None."""
    found = [c for c in converters if isinstance(c, GroupedExpertsConverter)]
    return found[0] if found else None


def low_precision_plan(converters: Sequence[ModelConverter], model: nn.Module, *, seq_len: int,
                       total_flops_per_token: float | None = None) -> str | None:
    """--print-fp8-plan's (and --dry-run-detail's) tables: the Linears' plan, then the experts' plan; None without a
    converter for either."""
    quantizer, experts = linear_quantizer(converters), expert_quantizer(converters)
    expert_flops = experts.fp8_flops_per_token(model) if experts is not None else 0.0
    parts = []
    if quantizer is not None:
        parts.append(quantizer.explain(model, seq_len=seq_len, total_flops_per_token=total_flops_per_token,
                                       expert_fp8_flops_per_token=expert_flops))
    if experts is not None:
        text = experts.explain(model)
        if quantizer is None and total_flops_per_token:  # no Linear table to carry the share line
            text += f"\nFP8 share: {100 * expert_flops / total_flops_per_token:.1f}% of the model's training FLOPs " \
                    f"per token at seq_len {seq_len} (attention included): the routed experts' grouped GEMMs"
        parts.append(text)
    return "\n\n".join(parts) if parts else None


def fp8_plan_summary(converters: Sequence[ModelConverter], model: nn.Module) -> str | None:
    """What the run's FP8 converters did to ``model`` (after ``convert``) in a few lines for the launch log, or
    None without one. The full table is --print-fp8-plan's (and --dry-run-detail's); --dry-run prints this summary."""
    experts = expert_quantizer(converters)
    expert_line = experts.summary() if experts is not None else None
    quantizer = linear_quantizer(converters)
    if quantizer is None or quantizer.plan is None:
        return expert_line
    seq_len = quantizer.context.seq_len
    flops_fn = getattr(model, "flops_per_token", None)
    total = flops_fn(seq_len) if callable(flops_fn) else None
    # After convert the experts keep their weights and names: their plan reads the same from the converted model.
    expert_flops = experts.fp8_flops_per_token(model) if experts is not None else 0.0
    text = (f"{quantizer.kind} converter ({quantizer.plan_config.recipe_name}): "
            + format_plan_summary(quantizer.plan, seq_len=seq_len, total_flops_per_token=total,
                                  expert_fp8_flops_per_token=expert_flops))
    return text if expert_line is None else f"{text}\n{expert_line}"
