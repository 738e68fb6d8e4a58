"""FP8 rowwise / MXFP8 / blockwise FP8 routed experts: the ``moe_experts`` converter swaps the grouped GEMM of every
expert module.

It converts what the Linear converters (float8, mx, float8_blockwise) cannot reach: the experts' 3-D weights,
computed as grouped GEMMs (torchtitan_lite.protocols.grouped_experts). It swaps no Linear, so it composes with
any of them, which then takes the attention (and dense feed-forward) Linears; DeepSeek-V3's recipe pairs
float8_blockwise with recipe blockwise here. The router gate stays in float32 under all of them: the MoE
router declares it (``high_precision_reason``) and every FP8 plan honours that.

Recipes (numerics in grouped_gemm.py):

- rowwise: e4m3 with power-of-2 scales per token and per expert output column (torchao's FP8 rowwise grouped
  GEMM, Hopper sm_90+); token groups padded to 16 rows;
- mxfp8: e4m3 in blocks of 32 along each GEMM's contraction dim with e8m0 scales (torchao's MXFP8 grouped GEMM,
  Blackwell sm_100+); token groups padded to 32 rows;
- blockwise: DeepSeek-V3's e4m3 in 1x128 activation / gradient tiles and 128x128 blocks of each expert's weight
  (float8_blockwise's numerics per expert, ``power_of_2_scales`` as there); token groups padded to 128 rows so
  that the weight gradient's tiles of 128 tokens never straddle two experts. Every expert weight's dims must be
  multiples of 128, and so must their expert-tensor-parallel shards.

Kernels (``kernel``): ``auto`` runs torchao's kernels where the GPU and this torchao build have them and
emulates everywhere else (CPU, older GPUs, a build without the kernels), logging why once; ``native`` makes
their absence an error; ``emulated`` always emulates (same tiles and scales, GEMM in the compute dtype).
Blockwise's kernel is torchao 0.18's grouped blockwise GEMM on DeepGEMM (blockwise_grouped_kernel.py): Hopper+,
the ``deep_gemm`` package, float32 scales and bfloat16 compute; without any of them ``auto`` emulates and
``native`` is an error naming what is missing and the fix.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import nn

from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK, tp_degrees_keeping_blocks
from torchtitan_lite.components.quantization.blockwise_grouped_kernel import (
    KERNEL_TEXT,
    NEED,
    NEED_TEXT,
    blockwise_fix,
    blockwise_kernel_missing,
    deep_gemm_missing,
)
from torchtitan_lite.components.quantization.float8_plan import AUTO_FILTER_SMALL_KN, filter_reason, too_small
from torchtitan_lite.components.quantization.grouped_gemm import (
    GROUP_ALIGNMENT,
    GROUPED_RECIPES,
    QuantizedGroupedMM,
)
from torchtitan_lite.protocols.grouped_experts import grouped_gemm_experts, high_precision_reason
from torchtitan_lite.protocols.model_converter import ConversionContext, ModelConverter
from torchtitan_lite.protocols.tp_misfits import TpMisfit, TpMisfits, exact_filter_entries, tp_misfits_message

logger = logging.getLogger(__name__)

_FIELD = "model_converters.converters[moe_experts]"
GROUPED_KERNELS = ("auto", "native", "emulated")
MIN_CAPABILITY = {"rowwise": (9, 0), "mxfp8": (10, 0)}
"""FP8 grouped GEMMs (torch._scaled_grouped_mm) need Hopper; MX block-scaled ones Blackwell."""
_RECIPE_TEXT = {"rowwise": "FP8 rowwise (e4m3, power-of-2 scales per token and per expert column)",
                "mxfp8": "MXFP8 (e4m3, 32-element blocks with e8m0 scales)",
                "blockwise": f"blockwise FP8 (e4m3, 1x{BLOCK} activation / gradient tiles, {BLOCK}x{BLOCK} blocks of "
                             f"each expert's weight"}
_TP_RULE = f"whole 1x{BLOCK} tiles and {BLOCK}x{BLOCK} weight blocks (the split dim / tp a multiple of {BLOCK})"
MIN_TOKENS_PER_EXPERT = 1024
"""With ``auto_filter_small_kn``: rowwise experts whose grouped GEMMs see fewer tokens per expert stay in BF16.
torchao puts the break-even of its FP8 rowwise grouped GEMMs near 500-1,000 tokens per expert; on an H200
(2026-11-27, BENCHMARKS.md) Qwen3-30B-A3B's experts (2048 x 768) at 1,024 tokens per expert, compiled, ran
0.84x of BF16, so the floor is the upper end and the shape rule below applies on top of it."""


@dataclass(frozen=True)
class ExpertPlanRow:
    """One expert weight's grouped GEMM (``experts`` > 0) or one high-precision Linear (a router gate)."""

    fqn: str
    experts: int
    """Experts of a grouped GEMM; 0 for a Linear."""
    in_features: int
    out_features: int
    recipe: str | None
    reason: str


@dataclass(frozen=True)
class GroupedKernelDecision:
    emulate: bool | None
    """True: emulated GEMMs; False: torchao's kernels; None: decided on the GPU at launch."""
    why: str


def decide_grouped_kernel(recipe: str, kernel: str, device_type: str, capability: tuple[int, int] | None,
                          device_name: str = "the GPU", kernels_built: bool = True, power_of_2: bool = False,
                          deep_gemm: str = "", compute_dtype: torch.dtype = torch.bfloat16) -> GroupedKernelDecision:
    """Emulate or not for ``recipe`` / ``kernel`` on this device; ValueError when ``kernel='native'`` cannot be
    honoured. ``kernels_built``: this torchao / triton build has the recipe's kernels; ``power_of_2``: blockwise
    scales rounded to powers of 2 (its emulated GEMM then runs in the compute dtype); ``deep_gemm``: blockwise
    only, what ``deep_gemm_missing()`` found lacking ('' when DeepGEMM runs); ``compute_dtype``: the experts'
    GEMM dtype (blockwise's kernel writes bfloat16 only)."""
    if kernel == "emulated":
        return GroupedKernelDecision(True, "grouped GEMMs emulated, as kernel='emulated' asks")
    if recipe == "blockwise":
        return _decide_blockwise(kernel, device_type, capability, device_name, deep_gemm, power_of_2, compute_dtype)
    need = MIN_CAPABILITY[recipe]
    need_text = f"compute capability {need[0]}.{need[1]}+ ({'Hopper' if recipe == 'rowwise' else 'Blackwell'})"
    emulated = "same tiles and scales, GEMM in the compute dtype; slower than BF16"
    if device_type != "cuda":
        if kernel == "native":
            raise ValueError(f"{_FIELD}.kernel='native' needs an NVIDIA GPU with {need_text}, and this run computes "
                             f"on {device_type}. Use kernel='auto' (emulates here) or kernel='emulated'")
        return GroupedKernelDecision(True, f"grouped GEMMs emulated: {device_type} has no {recipe} grouped GEMM "
                                           f"kernels (they need {need_text}); {emulated}")
    if capability is None:
        return GroupedKernelDecision(None, f"grouped GEMM kernels decided on the GPU at launch (torchao's on "
                                           f"{need_text}, else {'an error' if kernel == 'native' else 'emulated'})")
    found = f"{device_name} (compute capability {capability[0]}.{capability[1]})"
    missing = ("" if capability >= need else f"{found} lacks them (they need {need_text})") or (
        "" if kernels_built else f"this torchao build lacks the {recipe} grouped GEMM kernels for {found}")
    if not missing:
        return GroupedKernelDecision(False, f"torchao {recipe} grouped GEMM kernels on {found}")
    if kernel == "native":
        raise ValueError(f"{_FIELD}.kernel='native': {missing}. Use kernel='auto' to emulate ({emulated})"
                         + (", or recipe_name='rowwise' (Hopper)" if recipe == "mxfp8" else ""))
    return GroupedKernelDecision(True, f"grouped GEMMs emulated: {missing}; {emulated}")


def _decide_blockwise(kernel: str, device_type: str, capability: tuple[int, int] | None, device_name: str,
                      deep_gemm: str, power_of_2: bool, compute_dtype: torch.dtype) -> GroupedKernelDecision:
    """``decide_grouped_kernel`` for blockwise: torchao's grouped blockwise GEMM on DeepGEMM, or the emulation."""
    emulated_how = ("same tiles and scales, GEMM in the compute dtype (power-of-2 scales are exact in it)"
                    if power_of_2 else "same tiles and scales, GEMM in float32 (float32 scales); slower than BF16")
    missing = blockwise_kernel_missing(device_type, capability, device_name, deep_gemm, power_of_2, compute_dtype)
    if not missing and capability is None:
        return GroupedKernelDecision(None, f"grouped GEMM kernels decided on the GPU at launch ({KERNEL_TEXT} on "
                                           f"{NEED_TEXT} with deep_gemm installed, else "
                                           f"{'an error' if kernel == 'native' else 'emulated'})")
    if not missing:
        found = f"{device_name} (compute capability {capability[0]}.{capability[1]})"  # type: ignore[index]
        return GroupedKernelDecision(False, f"{KERNEL_TEXT} on {found}")
    if kernel == "native":
        raise ValueError(f"{_FIELD}.kernel='native' with recipe_name='blockwise' needs {KERNEL_TEXT}: "
                         f"{'; '.join(missing)}. Fix: {blockwise_fix(missing)}; or use kernel='auto' or "
                         f"kernel='emulated' to emulate ({emulated_how})")
    return GroupedKernelDecision(True, f"grouped GEMMs emulated: {'; '.join(missing)}; {emulated_how}")


def native_kernels_built(recipe: str) -> bool:
    """torchao's kernels for ``recipe`` can run in this process (triton; MXFP8's CUDA extension)."""
    from torch.utils._triton import has_triton

    if not has_triton():
        return False
    if recipe == "rowwise":
        return True
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _SM100_KERNELS_AVAILABLE

    return bool(_SM100_KERNELS_AVAILABLE)


class GroupedExpertsConverter(ModelConverter):
    """Runs the routed experts' grouped GEMMs in FP8 rowwise, MXFP8 or blockwise FP8 (torchao kernels or their
    emulation)."""

    @dataclass(kw_only=True)
    class Config(ModelConverter.Config):
        """FP8 rowwise / MXFP8 / blockwise FP8 routed experts (grouped GEMMs); combine with float8, mx or
        float8_blockwise for the Linears."""

        kind: ClassVar[str] = "moe_experts"
        swaps: ClassVar[str | None] = "grouped experts"
        low_precision_experts: ClassVar[bool] = True

        recipe_name: Literal["rowwise", "mxfp8", "blockwise"] = "rowwise"
        """rowwise: FP8 e4m3 with power-of-2 scales per token and per expert output column (Hopper kernels);
        mxfp8: e4m3 in 32-element blocks with e8m0 scales (Blackwell kernels); blockwise: DeepSeek-V3's e4m3 in
        1x128 tiles and 128x128 weight blocks (torchao's DeepGEMM kernels on Hopper with deep_gemm, else emulated)."""
        power_of_2_scales: bool = False
        """Round each tile's scale 448/amax down to a power of two (DeepSeek-V3's choice: scaling is exact).
        recipe_name='blockwise' only: rowwise and mxfp8 scales are powers of two already."""
        kernel: Literal["auto", "native", "emulated"] = "auto"
        """auto: torchao's grouped GEMM kernels where the GPU has them, emulated elsewhere with the reason logged;
        native: the kernels or an error; emulated: always emulate (exact numerics, slower than BF16)."""
        filter_fqns: list[str] = field(default_factory=list)
        """Expert weights whose FQN (e.g. 'layers.0.moe.experts.w2') contains any entry stay in high
        precision. 'auto_filter_small_kn' (rowwise only) also keeps in BF16 the expert weights whose grouped
        GEMM is predicted slower in FP8: fewer than MIN_TOKENS_PER_EXPERT tokens per expert (local batch x
        seq_len x top_k x ep / experts), or a weight (K = in, N = out) below torchao's dense rowwise size rule
        (N <= 2048, K <= 1024, or N <= 4096 and K <= 2048)."""

        def __post_init__(self) -> None:
            if self.recipe_name not in GROUPED_RECIPES:
                raise ValueError(f"{_FIELD}.recipe_name={self.recipe_name!r} is not one of: "
                                 f"{', '.join(GROUPED_RECIPES)}")
            if self.power_of_2_scales and self.recipe_name != "blockwise":
                raise ValueError(f"{_FIELD}.power_of_2_scales=true applies to recipe_name='blockwise' only: "
                                 f"{self.recipe_name}'s scales are powers of two already. Remove power_of_2_scales "
                                 f"or use recipe_name='blockwise'")
            if self.kernel not in GROUPED_KERNELS:
                raise ValueError(f"{_FIELD}.kernel={self.kernel!r} is not one of: {', '.join(GROUPED_KERNELS)}")
            for entry in self.filter_fqns:
                if not isinstance(entry, str) or not entry:
                    raise ValueError(f"{_FIELD}.filter_fqns entry {entry!r} would match every module; use non-empty "
                                     f"FQN substrings such as 'layers.0.moe.experts'")
            if AUTO_FILTER_SMALL_KN in self.filter_fqns and self.recipe_name != "rowwise":
                raise ValueError(f"{_FIELD}.filter_fqns entry {AUTO_FILTER_SMALL_KN!r} has a size rule for "
                                 f"recipe_name='rowwise' only (torchao's measured break-even); none is known for "
                                 f"{self.recipe_name!r} grouped experts. Remove the entry, or name the experts to "
                                 f"keep in high precision")

    config: GroupedExpertsConverter.Config

    def __init__(self, config: GroupedExpertsConverter.Config, *, context: ConversionContext) -> None:
        super().__init__(config, context=context)
        recipe = config.recipe_name
        capability, name = _cuda_device(context.device_type)
        built = native_kernels_built(recipe) if capability is not None and recipe != "blockwise" else True
        # deep_gemm is probed (imported) only where DeepGEMM could run: blockwise on a Hopper or newer GPU.
        probe = recipe == "blockwise" and capability is not None and capability >= NEED
        self.kernel = decide_grouped_kernel(recipe, config.kernel, context.device_type, capability, name, built,
                                            power_of_2=config.power_of_2_scales,
                                            deep_gemm=deep_gemm_missing() if probe else "",
                                            compute_dtype=context.param_dtype)
        self._check_precision()
        self._check_compile()
        self.plan: list[ExpertPlanRow] | None = None
        """The rows of the last ``convert``."""
        logger.info("%s: %s", _FIELD, self.kernel.why)

    def _check_compile(self) -> None:
        # As for the Linear converters: a config whose only low-precision part is the experts needs compile too.
        # Emulated (CPU, older GPUs) FP8 checks numerics and is slower than BF16 either way: no advice there.
        if self.kernel.emulate is False and not self.context.compile_model:
            logger.warning(
                "%s: FP8 / MX grouped experts without torch.compile of the model are usually slower than BF16: the "
                "per-token and per-column casts and scales run as separate eager kernels. Set compile.enable=true "
                "(with 'model' in compile.components) for speed", _FIELD)

    def _check_precision(self) -> None:
        dtype = self.context.param_dtype
        if dtype == torch.float16:
            why = ("the blockwise recipe computes in bfloat16 (DeepSeek-V3's choice) and needs no loss scaling"
                   if self.config.recipe_name == "blockwise" else "torchao's FP8 and MXFP8 grouped GEMMs write "
                                                                  "bfloat16 only")
            raise ValueError(f"{_FIELD} cannot be combined with precision.param_dtype=float16: {why}. Use "
                             f"precision.param_dtype=bfloat16")
        if dtype == torch.float32 and (self.config.kernel == "native" or self.kernel.emulate is False):
            raise ValueError(f"{_FIELD}: torchao's grouped GEMM kernels run here and write bfloat16 only, which "
                             f"precision.param_dtype=float32 cannot take. Use precision.param_dtype=bfloat16, or "
                             f"kernel='emulated' for float32 numerics")

    # ----------------------------------------------------------------------------------------------
    # Plan

    @property
    def alignment(self) -> int:
        return GROUP_ALIGNMENT[self.config.recipe_name]

    def plan_rows(self, model: nn.Module) -> list[ExpertPlanRow]:
        """Every expert weight of ``model`` with its recipe or why it stays in high precision, then every Linear
        its modules keep in high precision (the router gates)."""
        rows = self._rows(model)
        report = self._tp_misfits(rows)
        if report is not None:
            raise ValueError(tp_misfits_message([(None, report)], tp=self.context.tp))
        return rows

    def tp_misfits(self, model: nn.Module) -> TpMisfits | None:
        return self._tp_misfits(self._rows(model))

    def _rows(self, model: nn.Module) -> list[ExpertPlanRow]:
        rows = []
        for fqn, module in grouped_gemm_experts(model):
            names = type(module).grouped_gemm_weights  # type: ignore[attr-defined]
            # One GEMM primitive per module: a weight predicted slower keeps the module's other weights with it.
            slow = next(((name, why) for name in names
                         if (why := self._speed_reason(model, *getattr(module, name).shape[:0:-1]))), None)
            for name in names:
                experts, out_features, in_features = getattr(module, name).shape
                weight_fqn = f"{fqn}.{name}"
                reason = (filter_reason(weight_fqn, self.config.filter_fqns)
                          or ("" if module.use_grouped_mm else "use_grouped_mm=False: the per-expert loop runs no "
                                                               "grouped GEMM")
                          or self._shape_reason(in_features, out_features)
                          or ("" if slow is None else slow[1] if slow[0] == name else
                              f"with {slow[0]} (one recipe per experts module): {slow[1]}"))
                rows.append(ExpertPlanRow(weight_fqn, experts, in_features, out_features,
                                          None if reason else self.config.recipe_name, reason))
        for fqn, module in model.named_modules():
            reason = high_precision_reason(module)
            if reason:
                rows += [ExpertPlanRow(f"{fqn}.{sub}" if sub else fqn, 0, linear.in_features, linear.out_features,
                                       None, reason)
                         for sub, linear in module.named_modules() if isinstance(linear, nn.Linear)]
        return rows

    def fp8_flops_per_token(self, model: nn.Module) -> float:
        """Training FLOPs (forward + backward) per token of the expert grouped GEMMs this converter runs in low
        precision: 6 * in * out per weight for each of the top_k experts a token is sent to (the model's own
        FLOPs per token count its routed experts the same way, on the active parameters)."""
        facts_fn = getattr(model, "moe_facts", None)
        facts = facts_fn() if callable(facts_fn) else None
        if facts is None:
            return 0.0
        return float(sum(6 * row.in_features * row.out_features * facts.top_k
                         for row in self._rows(model) if row.experts and row.recipe is not None))

    def _shape_reason(self, in_features: int, out_features: int) -> str:
        align = self.alignment
        if self.config.recipe_name == "blockwise" and (in_features % BLOCK or out_features % BLOCK):
            return f"dims not multiples of {BLOCK} (1x{BLOCK} tiles, {BLOCK}x{BLOCK} weight blocks)"
        if in_features % align or out_features % align:
            return f"dims not divisible by {align} ({self.config.recipe_name} grouped GEMM alignment)"
        return ""

    def _speed_reason(self, model: nn.Module, in_features: int, out_features: int) -> str:
        """With ``auto_filter_small_kn``: why FP8 rowwise is predicted slower than BF16 for this expert weight."""
        if AUTO_FILTER_SMALL_KN not in self.config.filter_fqns:
            return ""
        facts_fn = getattr(model, "moe_facts", None)
        facts = facts_fn() if callable(facts_fn) else None
        tokens = self.context.tokens_per_forward
        if facts is not None and tokens:
            per_expert = tokens * facts.top_k * self.context.ep // facts.num_experts
            if per_expert < MIN_TOKENS_PER_EXPERT:
                return (f"{AUTO_FILTER_SMALL_KN}: ~{per_expert} tokens per expert (< {MIN_TOKENS_PER_EXPERT}), too "
                        f"few for FP8 rowwise grouped GEMMs to pay for their casts")
        if too_small("rowwise", in_features, out_features):
            return (f"{AUTO_FILTER_SMALL_KN}: K={in_features}, N={out_features} is below the rowwise size rule "
                    f"(slower than BF16: 0.84x measured for 2048 x 768 experts on an H200)")
        return ""

    def _tp_misfits(self, rows: list[ExpertPlanRow]) -> TpMisfits | None:
        """Expert tensor parallelism splits every expert's hidden dim (the family's shard dim of the weight, 1: out
        or 2: in): each rank's slice must hold whole 1x128 tiles and 128x128 blocks. Every blockwise expert weight
        whose slice would not, or None. An experts module runs all its weights in one recipe, so the filter keeps
        whole modules out."""
        tp = self.context.tp
        if tp == 1 or self.config.recipe_name != "blockwise":
            return None
        misfits = []
        for row in rows:
            dim = self.context.tp_shard_dim(row.fqn) if row.experts and row.recipe is not None else None
            if dim is None:
                continue
            split, name = (row.out_features, "out_features") if dim == 1 else (row.in_features, "in_features")
            fits = tp_degrees_keeping_blocks(split, tp)
            if fits is not None:
                misfits.append(TpMisfit(row.fqn, f"{row.experts} experts, {row.in_features} -> {row.out_features}, "
                                                 f"expert TP splits {name} {split} / {tp} = {split / tp:g}",
                                        tuple(fits)))
        if not misfits:
            return None
        modules = list(dict.fromkeys(m.fqn.rsplit(".", 1)[0] for m in misfits))
        others = [r.fqn for r in rows if r.experts and r.recipe is not None and r.fqn.rsplit(".", 1)[0] not in modules]
        return TpMisfits(_FIELD, _TP_RULE, tuple(misfits), exact_filter_entries(modules, others),
                         tuple(self.config.filter_fqns))

    # ----------------------------------------------------------------------------------------------
    # Converter protocol

    def convert(self, model: nn.Module) -> None:
        """Install the quantized grouped GEMM on every planned experts module (in place; weights untouched)."""
        self.plan = self.plan_rows(model)
        converted = {row.fqn for row in self.plan if row.recipe is not None}
        emulate = self.kernel.emulate is not False
        for fqn, module in grouped_gemm_experts(model):
            names = type(module).grouped_gemm_weights  # type: ignore[attr-defined]
            planned = [name for name in names if f"{fqn}.{name}" in converted]
            if not planned:
                continue
            if len(planned) != len(names):  # one GEMM primitive per module: all of its weights or none
                raise ValueError(f"{_FIELD}.filter_fqns keeps {sorted(set(names) - set(planned))} of {fqn} in high "
                                 f"precision but not {planned}: an experts module runs all its grouped GEMMs in one "
                                 f"recipe. Filter the whole module ('{fqn}') or none of its weights")
            # An instance attribute shadows the class's grouped_mm: the module keeps its type, parameters and
            # state-dict keys.
            vars(module)["grouped_mm"] = QuantizedGroupedMM(self.config.recipe_name, emulate, [],
                                                            power_of_2=self.config.power_of_2_scales)

    def post_optimizer_hook(self, model_parts: object) -> None:
        """Scales are dynamic: nothing to refresh."""

    def settings(self) -> str:
        text = _RECIPE_TEXT[self.config.recipe_name]
        if self.config.recipe_name == "blockwise":
            text += ", power-of-2 scales)" if self.config.power_of_2_scales else ", float32 scales)"
        return f"recipe {self.config.recipe_name}: {text}, token groups padded to {self.alignment} rows; {self.kernel.why}"

    def explain(self, model: nn.Module) -> str:
        return f"{self.kind} converter ({self.settings()})\n" + format_expert_plan(self.plan_rows(model))

    def summary(self) -> str | None:
        """The last ``convert``'s plan in one line, for the launch log."""
        if self.plan is None:
            return None
        gemms = [row for row in self.plan if row.experts]
        converted = sum(row.recipe is not None for row in gemms)
        routers = sum(not row.experts for row in self.plan)
        return (f"{self.kind} converter ({self.config.recipe_name}, "
                f"{'emulated' if self.kernel.emulate is not False else 'torchao kernels'}): {converted} of "
                f"{len(gemms)} expert grouped GEMMs in {self.config.recipe_name}; {routers} router gate(s) in "
                f"float32; every expert weight with its recipe or reason: --print-fp8-plan")

    @property
    def kind(self) -> str:
        return self.config.kind


def format_expert_plan(rows: list[ExpertPlanRow]) -> str:
    """A table of every expert weight and high-precision router gate with its recipe or reason."""
    gemms = [row for row in rows if row.experts]
    converted = sum(row.recipe is not None for row in gemms)
    header = ("fqn", "experts", "in", "out", "recipe", "high precision because")
    body = [(r.fqn, str(r.experts) if r.experts else "-", str(r.in_features), str(r.out_features), r.recipe or "-",
             r.reason) for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: tuple[str, ...]) -> str:
        return "  ".join(cell.rjust(w) if i in (1, 2, 3) else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

    lines = [f"Expert plan: {converted} of {len(gemms)} expert grouped GEMMs run in low precision "
             f"(in / out per expert); {len(rows) - len(gemms)} router Linear(s) stay in float32", fmt(header)]
    return "\n".join(lines + [fmt(line) for line in body])


def _cuda_device(device_type: str) -> tuple[tuple[int, int] | None, str]:
    """(compute capability, name) of the current GPU; (None, '') on CPU or without a visible GPU."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None, ""
    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()
