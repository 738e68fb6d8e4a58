"""DeepSeek-style blockwise FP8 (1x128 activation scales, 128x128 weight scales): refused, with the reason.

torchao 0.18 ships it as ``torchao.prototype.blockwise_fp8_training.Float8BlockwiseLinear``, and that
module cannot be trained or checked here:

- its quantization kernels are Triton kernels (``kernels.py`` imports triton at module level) and its
  constructor asserts an sm_90+ GPU: there is no CPU path and no emulation, unlike float8 and MX;
- it takes bfloat16 only, Linears without bias, and every dim a multiple of 128.

So no loss curve or SQNR of it can be measured on the hardware this project runs its tests on, and a
converter that is accepted but cannot be shown to train is worse than a clear refusal. The kind exists so
that asking for it says why and what to use instead, rather than "unknown kind".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torchtitan_lite.protocols.model_converter import ModelConverter

REFUSAL = (
    "model_converters.converters[float8_blockwise]: DeepSeek-style blockwise FP8 (1x128 activation / 128x128 "
    "weight scales) is not supported: torchao 0.18's Float8BlockwiseLinear runs only as Triton kernels on an "
    "sm_90+ GPU (no CPU path, no emulation), so it cannot be validated where this project is tested. For "
    "block-scaled FP8 use the mx converter (--model_converters.converters mx: MXFP8, 32-element blocks, real "
    "kernels on Blackwell, emulated elsewhere), or float8 with recipe_name='rowwise' on Ada / Hopper"
)


class Float8BlockwiseConverter(ModelConverter):
    """DeepSeek-style blockwise FP8: not supported (an error saying why and what to use: mx or float8 rowwise)."""

    @dataclass(kw_only=True)
    class Config(ModelConverter.Config):
        """Not supported: DeepSeek-style blockwise FP8 needs torchao's Triton kernels on an sm_90+ GPU; use mx."""

        kind: ClassVar[str] = "float8_blockwise"
        swaps: ClassVar[str | None] = "nn.Linear"

        def __post_init__(self) -> None:
            raise ValueError(REFUSAL)
