"""DeepSeek-V3 blockwise FP8 training: swap ``nn.Linear`` for ``BlockwiseFP8Linear`` (blockwise_linear.py).

Activations and gradients are cast to E4M3 in 1x128 tiles and weights in 128x128 blocks, each with its own
scale (blockwise_fp8.py has the tiling of each GEMM). One outlier coarsens only its own 128 neighbours (or
its weight block), where tensorwise scaling coarsens the whole tensor. Scales are float32 ``448 / amax``,
or, with ``power_of_2_scales``, rounded down to a power of two as DeepSeek-V3 does.

Kernels (``kernel``):

- ``native``: torchao 0.18's ``prototype.blockwise_fp8_training`` GEMM (``torch.nn.functional.scaled_mm``
  with BlockWise1x128 / BlockWise128x128 scales, Triton quantization kernels). Chosen conservatively: only
  on an sm_90 GPU (Hopper, where torchao's prototype is written for), with bfloat16 compute (its GEMM writes
  bfloat16), float32 scales (its kernels do not round scales to powers of two), ``training.seq_len`` a multiple
  of 128 (whole token tiles for the weight gradient) and both torchao's module and ``F.scaled_mm``
  importable; an error anywhere else. Not testable on a CPU.
- ``emulated``: quantizes and dequantizes the same tiles and multiplies in float32, on any device: the same
  numbers as the kernels up to accumulation order, slower than BF16.
- ``auto`` (default): native where it can run, emulated elsewhere, with the reason logged once and shown at
  the head of the --print-fp8-plan table.

Not there yet: the FP8 all-gather (FSDP gathers the high-precision weight; ``all_gather_itemsize`` None),
tensor parallelism (refused), float16 compute (refused).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn as nn

from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK
from torchtitan_lite.components.quantization.float8_plan import check_edge_fields, check_filter_fqns
from torchtitan_lite.components.quantization.linear_quantizer import LinearQuantizer, replace_linears
from torchtitan_lite.protocols.model_converter import ConversionContext, ModelConverter

logger = logging.getLogger(__name__)

BLOCKWISE_KERNELS = ("auto", "native", "emulated")
NATIVE_CAPABILITY = (9, 0)
"""torchao's blockwise prototype asserts sm_90 and is written for Hopper; newer GPUs are not assumed."""
_FIELD = "model_converters.converters[float8_blockwise]"

BlockwiseKernel = Literal["auto", "native", "emulated"]


@dataclass(frozen=True)
class BlockwiseKernelDecision:
    emulate: bool | None
    """True: emulated GEMMs; False: torchao's kernels; None: a GPU run resolved on a host without its GPU
    (decided again on the GPU at launch)."""
    why: str


def native_kernels_missing() -> str:
    """Why torchao's blockwise GEMM cannot be imported here, or '' when it can."""
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    try:
        import torchao.prototype.blockwise_fp8_training.linear  # noqa: F401
    except ImportError as err:
        return f"torchao's prototype.blockwise_fp8_training does not import ({err})"
    return ""


def decide_blockwise_kernel(kernel: str, *, device_type: str, capability: tuple[int, int] | None,
                            device_name: str = "the GPU", param_dtype: torch.dtype = torch.bfloat16,
                            power_of_2: bool = False, seq_len: int = BLOCK,
                            missing: str = "") -> BlockwiseKernelDecision:
    """Whether the blockwise GEMMs are emulated; ValueError when ``kernel='native'`` cannot be honoured.
    ``missing`` is ``native_kernels_missing()`` (passed in so the decision is testable without a GPU)."""
    if kernel == "emulated":
        return BlockwiseKernelDecision(True, "blockwise GEMMs emulated, as kernel='emulated' asks")
    emulated = "same tiles and scales as the FP8 kernels, multiplied in float32 (slower than BF16)"
    hopper = f"compute capability {NATIVE_CAPABILITY[0]}.{NATIVE_CAPABILITY[1]}, Hopper"
    if device_type != "cuda":
        obstacle = f"this run computes on {device_type}; torchao's blockwise kernels need an sm_90 GPU ({hopper})"
    elif capability is None:
        otherwise = "else an error" if kernel == "native" else "else emulated"
        return BlockwiseKernelDecision(None, f"blockwise kernels decided on the GPU at launch (kernel='{kernel}': "
                                             f"torchao's kernels on {hopper}, {otherwise})")
    elif capability != NATIVE_CAPABILITY:
        obstacle = (f"{device_name} (compute capability {capability[0]}.{capability[1]}) is not the sm_90 GPU "
                    f"torchao's blockwise kernels are written for ({hopper})")
    elif missing:
        obstacle = missing
    elif param_dtype != torch.bfloat16:
        obstacle = (f"torchao's blockwise GEMM writes bfloat16 only, and this run computes in "
                    f"{str(param_dtype).removeprefix('torch.')}")
    elif power_of_2:
        obstacle = "torchao's blockwise kernels compute float32 scales; power_of_2_scales=true needs the emulation"
    elif seq_len % BLOCK:
        obstacle = (f"training.seq_len={seq_len} is not a multiple of {BLOCK}: torchao's weight-gradient kernels take "
                    f"the tokens in whole 1x{BLOCK} tiles (the emulation pads the last one)")
    else:
        return BlockwiseKernelDecision(False, f"torchao's blockwise FP8 kernels on {device_name} ({hopper})")
    if kernel == "native":
        raise ValueError(f"{_FIELD}.kernel='native' cannot run here: {obstacle}. Use kernel='auto' (emulates "
                         f"here: {emulated}) or kernel='emulated'")
    return BlockwiseKernelDecision(True, f"blockwise GEMMs emulated: {obstacle}; {emulated}")


class Float8BlockwiseConverter(LinearQuantizer):
    """DeepSeek-V3 blockwise FP8 Linears: 1x128 activation / gradient tiles, 128x128 weight blocks, E4M3."""

    @dataclass(kw_only=True)
    class Config(ModelConverter.Config):
        """Blockwise FP8 Linears (DeepSeek-V3): 1x128 tiles, 128x128 weight blocks; torchao kernels on sm_90,
        emulated elsewhere."""

        kind: ClassVar[str] = "float8_blockwise"
        swaps: ClassVar[str | None] = "nn.Linear"

        power_of_2_scales: bool = False
        """Round each tile's scale 448/amax down to a power of two (DeepSeek-V3's choice: scaling is exact).
        Emulated only: torchao's kernels compute float32 scales."""
        kernel: BlockwiseKernel = "auto"
        """auto: torchao's kernels on an sm_90 GPU with bfloat16 compute, emulated elsewhere (reason logged);
        native: the kernels or an error; emulated: always emulate (same numbers, slower than BF16)."""
        filter_fqns: list[str] = field(default_factory=list)
        """Linears whose FQN contains any entry stay in high precision. Linears with in/out features not
        multiples of 128 (the tile) are always skipped."""
        keep_output_hp: bool = True
        """Keep the model's output projection (LM head) in high precision. Set false to convert it too."""
        keep_first_blocks_hp: int = 0
        """Keep every Linear of the first N transformer blocks in high precision (NeMo-style edges)."""
        keep_last_blocks_hp: int = 0
        """Keep every Linear of the last N transformer blocks in high precision (NeMo-style edges)."""

        @property
        def recipe_name(self) -> str:
            """The plan's recipe column."""
            return "blockwise"

        def shape_skip_reason(self, in_features: int, out_features: int) -> str:
            """Why a Linear of this shape stays in high precision, or ''."""
            if in_features % BLOCK or out_features % BLOCK:
                return f"dims not multiples of {BLOCK} (1x{BLOCK} tiles, {BLOCK}x{BLOCK} weight blocks)"
            return ""

        def __post_init__(self) -> None:
            check_edge_fields(self, _FIELD)
            if self.kernel not in BLOCKWISE_KERNELS:
                raise ValueError(f"{_FIELD}.kernel={self.kernel!r} is not one of: {', '.join(BLOCKWISE_KERNELS)}")
            check_filter_fqns(self, _FIELD)

    config: Float8BlockwiseConverter.Config

    def __init__(self, config: Float8BlockwiseConverter.Config, *, context: ConversionContext) -> None:
        super().__init__(config, context=context)
        self._check_layout()
        on_gpu = context.device_type == "cuda" and torch.cuda.is_available()
        self.kernel = decide_blockwise_kernel(
            config.kernel, device_type=context.device_type,
            capability=torch.cuda.get_device_capability() if on_gpu else None,
            device_name=torch.cuda.get_device_name() if on_gpu else "the GPU", param_dtype=context.param_dtype,
            power_of_2=config.power_of_2_scales, seq_len=context.seq_len,
            missing=native_kernels_missing() if on_gpu and config.kernel != "emulated" else "")
        logger.info("%s: %s", _FIELD, self.kernel.why)

    def _check_layout(self) -> None:
        if self.context.param_dtype == torch.float16:
            raise ValueError(f"{_FIELD} cannot be combined with precision.param_dtype=float16: the blockwise recipe "
                             f"computes in bfloat16 (DeepSeek-V3's and torchao's choice; torchao's GEMM writes "
                             f"bfloat16 only) and needs no loss scaling. Use precision.param_dtype=bfloat16, or "
                             f"float32 to emulate in float32")
        if self.context.tp_enabled:
            raise ValueError(f"{_FIELD} does not support tensor parallelism yet (its 128-element tiles and blocks "
                             f"are not sharded across TP ranks). Set parallelism.tp=1 and shard with FSDP "
                             f"(parallelism.dp_shard), or use the float8 converter's rowwise recipe with TP")

    # ----------------------------------------------------------------------------------------------
    # The recipe's part of LinearQuantizer

    def swap(self, model: nn.Module, planned: set[str]) -> None:
        from torchtitan_lite.components.quantization.blockwise_linear import blockwise_linear_from

        emulate, power_of_2 = self.kernel.emulate is not False, self.config.power_of_2_scales
        replace_linears(model, planned,
                        lambda linear: blockwise_linear_from(linear, emulate=emulate, power_of_2=power_of_2))

    def settings(self) -> str:
        scales = "power-of-2 scales" if self.config.power_of_2_scales else "float32 scales"
        return (f"E4M3, 1x{BLOCK} activation / gradient tiles, {BLOCK}x{BLOCK} weight blocks, {scales}; "
                f"{self.kernel.why}; FSDP all-gathers the weights in the parameter dtype (no FP8 all-gather for "
                f"blockwise yet)")

    @property
    def casts_master_weight(self) -> bool:
        # BlockwiseFP8Linear takes its operands in the compute dtype: an autocast copy of the weight without FSDP.
        return False
