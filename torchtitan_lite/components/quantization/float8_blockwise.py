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

FSDP all-gather (``enable_fsdp_float8_all_gather``, on by default): each rank quantizes its shard of a converted
weight into 128x128 blocks and FSDP gathers the E4M3 data and block scales, 1 + 4/16384 bytes per element
instead of 2 (blockwise_weight.py). A Linear whose FSDP shards do not hold whole 128-row blocks, or that runs
on torchao's kernels (their GEMM takes a high-precision weight), is gathered in the parameter dtype; the plan
and the launch log say which and why.

Tensor parallelism: column-wise and row-wise shards must hold whole 128-element tiles and blocks (the TP-split
dim / tp a multiple of 128), else one error names every Linear (and routed expert) a shard would cut, the degrees
that fit them all and the filter_fqns entries that keep exactly those in high precision. TP communication stays in the
parameter dtype (the 1x128 activation tiles are quantized inside the Linear, after the gather).

Not there yet: float16 compute (refused).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn as nn

from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK, tp_degrees_keeping_blocks
from torchtitan_lite.components.quantization.blockwise_weight import (
    FP8_ALL_GATHER_BYTES_PER_ELEMENT,
    fp8_all_gather_obstacle,
    wrap_for_fp8_all_gather,
)
from torchtitan_lite.components.quantization.float8_plan import PlanRow, check_edge_fields, check_filter_fqns
from torchtitan_lite.components.quantization.linear_quantizer import LinearQuantizer, replace_linears
from torchtitan_lite.protocols.model_converter import ConversionContext, ModelConverter
from torchtitan_lite.protocols.tp_misfits import TpMisfit, TpMisfits, exact_filter_entries, tp_misfits_message

logger = logging.getLogger(__name__)

BLOCKWISE_KERNELS = ("auto", "native", "emulated")
NATIVE_CAPABILITY = (9, 0)
"""torchao's blockwise prototype asserts sm_90 and is written for Hopper; newer GPUs are not assumed."""
_FIELD = "model_converters.converters[float8_blockwise]"
_FP8_BLOCKS = "E4M3 + a float32 scale per block"
_TP_RULE = f"whole 1x{BLOCK} tiles and {BLOCK}x{BLOCK} weight blocks (the split dim / tp a multiple of {BLOCK})"

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
        # Said up front because it looks like a hang: on an H200 the first forward + backward of one shape
        # spent ~100 s autotuning six Triton kernels (2026-11-27, torch 2.11, torchao 0.18); later calls 0.02 s.
        return BlockwiseKernelDecision(False, f"torchao's blockwise FP8 kernels on {device_name} ({hopper}); the "
                                              f"first step autotunes their Triton quantization kernels for every "
                                              f"Linear shape (about 100 s per shape measured on an H200)")
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
        enable_fsdp_float8_all_gather: bool = True
        """FSDP all-gathers the converted weights as 128x128-block FP8 quantized on each rank (about half the
        bytes of bf16) where every shard holds whole 128-row blocks and the GEMMs are emulated; elsewhere, or
        when false, in the parameter dtype. No effect without FSDP sharding."""

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

    # ----------------------------------------------------------------------------------------------
    # The recipe's part of LinearQuantizer

    def plan_rows(self, model: nn.Module) -> list[PlanRow]:
        rows = super().plan_rows(model)
        report = self._tp_misfits(rows)
        if report is not None:
            raise ValueError(tp_misfits_message([(None, report)], tp=self.context.tp))
        return rows

    def tp_misfits(self, model: nn.Module) -> TpMisfits | None:
        return self._tp_misfits(super().plan_rows(model))

    def _tp_misfits(self, rows: list[PlanRow]) -> TpMisfits | None:
        """Every converted Linear whose column-wise or row-wise TP shard would cut its tiles and blocks, or None."""
        tp = self.context.tp
        if tp == 1:
            return None
        misfits = []
        for row in rows:
            dim = self.context.tp_shard_dim(row.fqn) if row.recipe is not None else None
            if dim is None:
                continue
            split, name = (row.out_features, "out_features") if dim == 0 else (row.in_features, "in_features")
            fits = tp_degrees_keeping_blocks(split, tp)
            if fits is not None:
                style = "column-wise" if dim == 0 else "row-wise"
                misfits.append(TpMisfit(row.fqn, f"{row.in_features} -> {row.out_features}, {style}: {name} {split} "
                                                 f"/ {tp} = {split / tp:g}", tuple(fits)))
        if not misfits:
            return None
        names = {m.fqn for m in misfits}
        return TpMisfits(_FIELD, _TP_RULE, tuple(misfits),
                         exact_filter_entries([m.fqn for m in misfits],
                                              [r.fqn for r in rows if r.recipe is not None and r.fqn not in names]),
                         tuple(self.config.filter_fqns))

    def fp8_all_gather_reasons(self, rows: list[PlanRow]) -> dict[str, str]:
        """Converted Linear FQN -> why FSDP gathers its weight in the parameter dtype ('': as FP8 blocks).
        Empty without FSDP sharding."""
        if not self.context.fsdp_sharded:
            return {}
        why = ""
        if not self.config.enable_fsdp_float8_all_gather:
            why = "enable_fsdp_float8_all_gather=false"
        elif self.kernel.emulate is False:
            why = "torchao's blockwise GEMM takes a high-precision weight and quantizes it itself"
        elif self.kernel.emulate is None:
            why = "kernel decided on the GPU at launch; torchao's GEMM would take a high-precision weight"
        ctx = self.context
        return {row.fqn: why or fp8_all_gather_obstacle(row.out_features, row.in_features, dp_shard=ctx.dp_shard,
                                                       tp=ctx.tp, tp_shard_dim=ctx.tp_shard_dim(row.fqn))
                for row in rows if row.recipe is not None}

    def fp8_all_gather_text(self, rows: list[PlanRow]) -> str:
        """Which converted Linears FSDP gathers as FP8 blocks, and why the others are not (Linears of the
        transformer blocks grouped as <blocks>.*)."""
        reasons = self.fp8_all_gather_reasons(rows)
        if not reasons:
            return "FSDP all-gather: none (no FSDP sharding)"
        fp8 = [fqn for fqn, why in reasons.items() if not why]
        per_element = f"{FP8_ALL_GATHER_BYTES_PER_ELEMENT:.6g} bytes/element: {_FP8_BLOCKS}"
        lines = [f"FSDP all-gather (dp_shard={self.context.dp_shard}): {len(fp8)} of {len(reasons)} blockwise "
                 f"Linears gather FP8 blocks ({per_element}); the rest the parameter dtype"]
        groups: dict[str, list[str]] = {}
        blocks = self.context.blocks
        for fqn, why in reasons.items():
            groups.setdefault(why, [])
            generic = re.sub(rf"^{re.escape(blocks)}\.\d+\.", f"{blocks}.*.", fqn)
            if generic not in groups[why]:
                groups[why].append(generic)
        for why, fqns in groups.items():
            lines.append(f"  {'FP8' if not why else 'high precision'}: {', '.join(fqns)}" + (f" ({why})" if why else ""))
        return "\n".join(lines)

    def convert(self, model: nn.Module) -> None:
        super().convert(model)
        if self.plan is not None and self.context.fsdp_sharded:
            logger.info("%s: %s", _FIELD, self.fp8_all_gather_text(self.plan))

    def explain(self, model: nn.Module, *, seq_len: int | None = None,
                total_flops_per_token: float | None = None, expert_fp8_flops_per_token: float = 0.0) -> str:
        text = super().explain(model, seq_len=seq_len, total_flops_per_token=total_flops_per_token,
                               expert_fp8_flops_per_token=expert_fp8_flops_per_token)
        return text + "\n" + self.fp8_all_gather_text(self.plan_rows(model))

    def swap(self, model: nn.Module, planned: set[str]) -> None:
        from torchtitan_lite.components.quantization.blockwise_linear import blockwise_linear_from

        emulate, power_of_2 = self.kernel.emulate is not False, self.config.power_of_2_scales
        replace_linears(model, planned,
                        lambda linear: blockwise_linear_from(linear, emulate=emulate, power_of_2=power_of_2))
        gathered = [fqn for fqn, why in self.fp8_all_gather_reasons(self.plan or []).items() if not why]
        shared = _shared_weights(model)
        for fqn in gathered:
            linear = model.get_submodule(fqn)
            assert isinstance(linear, nn.Linear)
            if id(linear.weight) in shared:
                # A tied weight is also read as a plain tensor (the embedding): it must stay high precision.
                raise ValueError(f"{_FIELD}: {fqn}.weight is tied to another module, which cannot read FP8 blocks; "
                                 f"set enable_fsdp_float8_all_gather=false or keep {fqn} in high precision")
            wrap_for_fp8_all_gather(linear, power_of_2=power_of_2)

    def all_gather_per_linear(self, rows: list[PlanRow]) -> dict[str, tuple[float | None, str]]:
        return {fqn: (None, why) if why else (FP8_ALL_GATHER_BYTES_PER_ELEMENT, _FP8_BLOCKS)
                for fqn, why in self.fp8_all_gather_reasons(rows).items()}

    @property
    def fsdp_float8_all_gather(self) -> bool:
        """Some converted weights may be gathered as FP8 (the run shards with FSDP, the option is on, emulated)."""
        return self.context.fsdp_sharded and self.config.enable_fsdp_float8_all_gather and self.kernel.emulate is True

    def settings(self) -> str:
        scales = "power-of-2 scales" if self.config.power_of_2_scales else "float32 scales"
        return (f"E4M3, 1x{BLOCK} activation / gradient tiles, {BLOCK}x{BLOCK} weight blocks, {scales}; "
                f"{self.kernel.why}")

    @property
    def casts_master_weight(self) -> bool:
        # BlockwiseFP8Linear takes its operands in the compute dtype: an autocast copy of the weight without FSDP.
        return False


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}
