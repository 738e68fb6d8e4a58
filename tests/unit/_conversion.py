"""A ConversionContext as resolve_run makes it, for converter tests that need no whole config."""
from __future__ import annotations

from torchtitan_lite.components.precision import Precision, resolve_precision
from torchtitan_lite.protocols.model_converter import ConversionContext


def context(param_dtype: str = "bfloat16", *, fsdp: bool = False, compile_model: bool = True, tp: bool = False,
            seq_len: int = 32, device_type: str = "cpu") -> ConversionContext:
    precision = resolve_precision(Precision.Config(param_dtype=param_dtype), device_type=device_type,
                                  fsdp_enabled=fsdp)
    return ConversionContext(device_type=device_type, param_dtype=precision.param_dtype, autocast=precision.autocast,
                             fsdp_sharded=fsdp, tp_enabled=tp, compile_model=compile_model, seq_len=seq_len,
                             output_module="output", blocks="layers")
