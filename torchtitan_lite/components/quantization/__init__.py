"""Quantized-training converters; importing this package registers their kinds."""
from __future__ import annotations

from collections.abc import Sequence

from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.linear_quantizer import LinearQuantizer
from torchtitan_lite.components.quantization.mx import MXLinearConverter
from torchtitan_lite.protocols.model_converter import ModelConverter

__all__ = ["Float8BlockwiseConverter", "Float8LinearConverter", "LinearQuantizer", "MXLinearConverter",
           "linear_quantizer"]


def linear_quantizer(converters: Sequence[ModelConverter]) -> LinearQuantizer | None:
    """The run's converter that trains Linears in low precision (float8, MX), or None. There is at most one:
    two converters that swap nn.Linear are refused by the container."""
    found = [c for c in converters if isinstance(c, LinearQuantizer)]
    return found[0] if found else None
