"""MXFP8 training: swap ``nn.Linear`` for torchao 0.18's ``MXFP8Linear`` (torchao.prototype.moe_training).

MXFP8 (OCP Microscaling) casts the input, the weight and the output gradient of every GEMM of a
Linear's forward and backward to float8 e4m3 with one power-of-two scale (e8m0) per block of 32
consecutive elements along the GEMM's reduction dim. Scales are computed with torchao's RCEIL rule
(round the block's amax / 448 up to a power of two), so no element overflows. Compared with float8
tensorwise / rowwise, one outlier only coarsens its own 32 neighbours.

Recipes:

- mxfp8: all three GEMMs (output, input gradient, weight gradient) in MXFP8;
- mxfp8_wgrad_with_hp: the weight-gradient GEMM stays in high precision (more accurate, slower).

Kernels (``kernel``): real MX GEMMs need tensor cores with block scaling, which arrived with
Blackwell (compute capability 10.0). ``auto`` runs them there and emulates everywhere else (below
sm_100 and on CPU), logging why; emulation quantizes and dequantizes with exactly the MX rounding and
runs the GEMM in the compute dtype, so the numerics are those of MXFP8 and the speed is below BF16.
``native`` requires the real kernels and is an error without them; ``emulated`` always emulates.

torchao's MX GEMM writes bfloat16 only, and torchao has no float16 MX path: MX runs with bfloat16
compute (or float32 when emulated).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn as nn

from torchtitan_lite.compat import inductor_cpu_mx_cast_error
from torchtitan_lite.components.quantization.float8_plan import check_edge_fields, check_filter_fqns
from torchtitan_lite.components.quantization.linear_quantizer import LinearQuantizer, replace_linears
from torchtitan_lite.protocols.model_converter import ConversionContext, ModelConverter

logger = logging.getLogger(__name__)

MX_RECIPES = ("mxfp8", "mxfp8_wgrad_with_hp")
MX_KERNELS = ("auto", "native", "emulated")
MX_BLOCK = 32
"""Elements per MX scale (OCP MX v1.0): every GEMM dim that blocks are taken along is a multiple of it."""
MIN_MX_CAPABILITY = (10, 0)
"""MX block-scaled tensor cores arrived with Blackwell (sm_100)."""
_FIELD = "model_converters.converters[mx]"

MXRecipe = Literal["mxfp8", "mxfp8_wgrad_with_hp"]
MXKernel = Literal["auto", "native", "emulated"]


@dataclass(frozen=True)
class MXKernelDecision:
    emulate: bool | None
    """True: emulated GEMMs; False: real MX kernels; None: not decidable here (a GPU job resolved on a
    host without a GPU: decided again on the GPU at launch)."""
    why: str


def decide_mx_kernel(kernel: str, device_type: str, capability: tuple[int, int] | None,
                     device_name: str = "the GPU") -> MXKernelDecision:
    """Whether MX GEMMs are emulated for ``kernel`` on ``device_type`` with CUDA ``capability`` (None: not
    known here); ValueError when ``kernel='native'`` cannot be honoured."""
    if kernel == "emulated":
        return MXKernelDecision(True, "MX GEMMs emulated, as kernel='emulated' asks")
    need = f"{MIN_MX_CAPABILITY[0]}.{MIN_MX_CAPABILITY[1]}"
    emulated = "exact MXFP8 numerics, slower than BF16"
    if device_type != "cuda":
        if kernel == "native":
            raise ValueError(f"{_FIELD}.kernel='native' needs an NVIDIA GPU with MX tensor cores (compute capability "
                             f"{need}+, Blackwell), and this run computes on {device_type}. Use kernel='auto' (emulates "
                             f"here) or kernel='emulated'")
        return MXKernelDecision(True, f"MX GEMMs emulated: {device_type} has no MX tensor cores (they need compute "
                                      f"capability {need}+, Blackwell); {emulated}")
    if capability is None:
        otherwise = "else an error" if kernel == "native" else "else emulated"
        return MXKernelDecision(None, f"MX kernels decided on the GPU at launch (kernel='{kernel}': real MX kernels on "
                                      f"compute capability {need}+, {otherwise})")
    found = f"{device_name} (compute capability {capability[0]}.{capability[1]})"
    if capability >= MIN_MX_CAPABILITY:
        return MXKernelDecision(False, f"real MX kernels: {found} has MX tensor cores")
    if kernel == "native":
        raise ValueError(f"{_FIELD}.kernel='native': {found} has no MX tensor cores (needs {need}+, Blackwell). Use "
                         f"kernel='auto' to emulate MXFP8 here ({emulated}), or the float8 converter (rowwise: "
                         f"per-row scales on Ada / Hopper FP8 tensor cores)")
    return MXKernelDecision(True, f"MX GEMMs emulated: {found} has no MX tensor cores (they need {need}+, Blackwell); "
                                  f"{emulated}. For FP8 speed here use the float8 converter; set kernel='native' to "
                                  f"make this an error instead")


class MXLinearConverter(LinearQuantizer):
    """MXFP8 training of nn.Linear layers (torchao MXFP8Linear): 32-element blocks with e8m0 scales."""

    @dataclass(kw_only=True)
    class Config(ModelConverter.Config):
        """MXFP8 Linears: e4m3 elements, one e8m0 scale per 32; real kernels on Blackwell, emulated elsewhere."""

        kind: ClassVar[str] = "mx"
        swaps: ClassVar[str | None] = "nn.Linear"

        recipe_name: MXRecipe = "mxfp8"
        """MX recipe: mxfp8 (all three GEMMs in MXFP8) or mxfp8_wgrad_with_hp (the weight-gradient GEMM in
        high precision: more accurate, slower)."""
        kernel: MXKernel = "auto"
        """auto: real MX kernels on Blackwell (compute capability 10.0+), emulated elsewhere with the reason
        logged; native: real kernels or an error; emulated: always emulate (exact numerics, slower than BF16)."""
        filter_fqns: list[str] = field(default_factory=list)
        """Linears whose FQN contains any entry stay in high precision. Linears with in/out features not
        divisible by 32 (the MX block) are always skipped."""
        keep_output_hp: bool = True
        """Keep the model's output projection (LM head) in high precision. Set false to convert it too."""
        keep_first_blocks_hp: int = 0
        """Keep every Linear of the first N transformer blocks in high precision (NeMo-style edges)."""
        keep_last_blocks_hp: int = 0
        """Keep every Linear of the last N transformer blocks in high precision (NeMo-style edges)."""

        def shape_skip_reason(self, in_features: int, out_features: int) -> str:
            """Why a Linear of this shape stays in high precision, or ''."""
            if in_features % MX_BLOCK or out_features % MX_BLOCK:
                return f"dims not divisible by {MX_BLOCK} (MX block)"
            return ""

        def __post_init__(self) -> None:
            check_edge_fields(self, _FIELD)
            if self.recipe_name not in MX_RECIPES:
                raise ValueError(f"{_FIELD}.recipe_name={self.recipe_name!r} is not one of: {', '.join(MX_RECIPES)}")
            if self.kernel not in MX_KERNELS:
                raise ValueError(f"{_FIELD}.kernel={self.kernel!r} is not one of: {', '.join(MX_KERNELS)}")
            check_filter_fqns(self, _FIELD)

    config: MXLinearConverter.Config

    def __init__(self, config: MXLinearConverter.Config, *, context: ConversionContext) -> None:
        super().__init__(config, context=context)
        capability, name = _cuda_device(context.device_type)
        self.kernel = decide_mx_kernel(config.kernel, context.device_type, capability, name)
        self._check_precision()
        self._check_sequence()
        self._check_compile()
        if self.kernel.emulate:
            logger.info("%s: %s", _FIELD, self.kernel.why)
        elif self.kernel.emulate is False and not context.compile_model:
            logger.warning("MX training without torch.compile of the model is usually slower than BF16: the MX casts "
                           "run as separate eager kernels. Set compile.enable=true (with 'model' in compile.components)")

    def _check_precision(self) -> None:
        dtype = self.context.param_dtype
        if dtype == torch.float16:
            raise ValueError(f"{_FIELD} cannot be combined with precision.param_dtype=float16: torchao 0.18 has no "
                             f"float16 MX path and its MX GEMM writes bfloat16. Use precision.param_dtype=bfloat16")
        if dtype == torch.float32 and (self.config.kernel == "native" or self.kernel.emulate is False):
            raise ValueError(f"{_FIELD}.kernel='{self.config.kernel}' runs the real MX kernels here, and with "
                             f"precision.param_dtype=float32 that cannot work: the MX GEMM writes bfloat16 only. Use "
                             f"precision.param_dtype=bfloat16, or kernel='emulated' for float32 numerics")

    def _check_compile(self) -> None:
        if not (self.context.compile_model and self.context.device_type == "cpu"):
            return
        error = inductor_cpu_mx_cast_error()
        if error is not None:
            raise ValueError(f"{_FIELD} with compile.enable=true on CPU needs torch 2.13: torch {torch.__version__}'s "
                             f"inductor cannot compile the MX casts for CPU ({error}). Set compile.enable=false (or "
                             f"leave 'model' out of compile.components), or run on a GPU")

    def _check_sequence(self) -> None:
        # The weight-gradient GEMM reduces over the tokens, so MX blocks run along them too.
        seq_len = self.context.seq_len
        if self.config.recipe_name == "mxfp8" and seq_len % MX_BLOCK:
            raise ValueError(f"{_FIELD}: training.seq_len={seq_len} must be a multiple of {MX_BLOCK}: recipe 'mxfp8' "
                             f"quantizes the weight-gradient GEMM in blocks of {MX_BLOCK} tokens. Use training.seq_len="
                             f"{max(MX_BLOCK, seq_len // MX_BLOCK * MX_BLOCK)}, or recipe_name='mxfp8_wgrad_with_hp'")

    # ----------------------------------------------------------------------------------------------
    # The recipe's part of LinearQuantizer

    def swap(self, model: nn.Module, planned: set[str]) -> None:
        replace_linears(model, planned, self.mx_linear)

    def mx_linear(self, linear: nn.Linear) -> nn.Linear:
        """An MX Linear holding ``linear``'s own parameters (shared, not copied)."""
        from torchtitan_lite.components.quantization.mx_linear import mx_linear_from

        return mx_linear_from(linear, emulate=self.kernel.emulate is not False,
                              wgrad_with_hp=self.config.recipe_name == "mxfp8_wgrad_with_hp")

    def settings(self) -> str:
        return f"recipe {self.config.recipe_name}, {MX_BLOCK}-element blocks with e8m0 scales; {self.kernel.why}"

    @property
    def casts_master_weight(self) -> bool:
        # MXFP8Linear takes its operands in the compute dtype: an autocast copy of the weight without FSDP.
        return False


def _cuda_device(device_type: str) -> tuple[tuple[int, int] | None, str]:
    """(compute capability, name) of the current GPU; (None, '') on CPU or without a visible GPU."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None, ""
    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()
