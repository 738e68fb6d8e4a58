"""Quantized-training converters; importing this package registers their kinds."""
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter

__all__ = ["Float8LinearConverter"]
