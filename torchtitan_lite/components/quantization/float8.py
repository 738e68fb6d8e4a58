"""FP8 training: swap ``nn.Linear`` for torchao's ``Float8Linear`` (torchao.float8, torchao 0.18).

Each converted Linear casts its input, weight and output gradient to float8 (e4m3 / e5m2) with
dynamic scales computed from the current amax, runs the three GEMMs of forward/backward with
``torch._scaled_mm``, and keeps its master weight in high precision. Recipes:

- tensorwise: one scale per tensor; fastest; supports FP8 FSDP all-gather.
- rowwise: one scale per row, power-of-2 scales; more accurate with outliers, somewhat slower.
- rowwise_with_gw_hp: rowwise, but the weight-gradient GEMM stays in high precision; most accurate.

Every rule that would otherwise silently do nothing is explicit here (errors name the fix).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn as nn

from torchtitan_lite.compat import float8_recipe_needs_emulation
from torchtitan_lite.components.quantization.float8_plan import (
    AUTO_FILTER_SMALL_KN,
    check_edge_fields,
    check_filter_fqns,
    float8_shape_reason,
)
from torchtitan_lite.components.quantization.linear_quantizer import LinearQuantizer
from torchtitan_lite.cpu_scaled_mm import replacement_note
from torchtitan_lite.protocols.model_converter import ConversionContext, ModelConverter

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_FIELD = "model_converters.converters[float8]"
# FP8 tensor cores arrived with Ada (sm_89) and Hopper (sm_90).
MIN_FP8_CAPABILITY = (8, 9)

Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""torchao's float8 training recipes (Float8LinearConfig.from_recipe_name)."""

ROWWISE_GATHERS_HIGH_PRECISION = (
    "per-row scales do shard along dim 0 with the weight, but the input-gradient GEMM (dX = dY W) needs the weight "
    "scaled along its other axis, so one gathered float8 copy cannot serve both GEMMs")
"""Why FSDP gathers a rowwise weight in the parameter dtype (blockwise's square blocks serve both GEMMs)."""


class Float8LinearConverter(LinearQuantizer):
    @dataclass(kw_only=True)
    class Config(ModelConverter.Config):
        kind: ClassVar[str] = "float8"
        swaps: ClassVar[str | None] = "nn.Linear"

        recipe_name: Float8Recipe = "tensorwise"
        """FP8 scaling recipe: tensorwise (fastest, supports FP8 all-gather), rowwise (per-row scales,
        more accurate), rowwise_with_gw_hp (rowwise with the weight-gradient GEMM in high precision)."""
        enable_fsdp_float8_all_gather: bool = False
        """All-gather FSDP-sharded weights in float8 (half the bytes of bf16). Tensorwise only; has no
        effect without FSDP sharding."""
        precompute_float8_dynamic_scale_for_fsdp: bool = False
        """Compute the float8 scales of all FSDP weights with one all-reduce right after each optimizer
        step instead of one per layer during forward. Needs enable_fsdp_float8_all_gather."""
        filter_fqns: list[str] = field(default_factory=list)
        """Linears whose FQN contains any entry stay in high precision (e.g. 'output'). The entry
        'auto_filter_small_kn' also skips layers too small to gain from FP8 for the recipe (torchao's
        size rules). Linears with in/out features not divisible by 16 are always skipped."""
        emulate: bool = False
        """Emulate FP8 GEMMs in high precision: FP8 numerics on GPUs without FP8 tensor cores (testing
        only; slower than BF16)."""
        keep_output_hp: bool = True
        """Keep the model's output projection (LM head) in high precision. Set false to convert it too."""
        keep_first_blocks_hp: int = 0
        """Keep every Linear of the first N transformer blocks in high precision (NeMo-style edges)."""
        keep_last_blocks_hp: int = 0
        """Keep every Linear of the last N transformer blocks in high precision (NeMo-style edges)."""

        def shape_skip_reason(self, in_features: int, out_features: int) -> str:
            """Why a Linear of this shape stays in high precision under this recipe, or ''."""
            return float8_shape_reason(in_features, out_features, recipe_name=self.recipe_name,
                                       filter_fqns=self.filter_fqns)

        def __post_init__(self) -> None:
            check_edge_fields(self, _FIELD)
            if self.recipe_name not in RECIPES:
                blockwise = ("; DeepSeek-V3 blockwise FP8 is its own converter: --model_converters.converters "
                             "float8_blockwise" if self.recipe_name == "blockwise" else "")
                raise ValueError(f"{_FIELD}.recipe_name={self.recipe_name!r} is not one of: {', '.join(RECIPES)}"
                                 f"{blockwise}")
            check_filter_fqns(self, _FIELD)
            if self.enable_fsdp_float8_all_gather and self.recipe_name != "tensorwise":
                raise ValueError(
                    f"{_FIELD}: enable_fsdp_float8_all_gather=True needs recipe_name='tensorwise', got "
                    f"{self.recipe_name!r} ({ROWWISE_GATHERS_HIGH_PRECISION}). Set enable_fsdp_float8_all_gather=false "
                    f"or use recipe_name='tensorwise' (or the float8_blockwise converter, whose 128x128 weight blocks "
                    f"serve both GEMMs)"
                )
            if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
                raise ValueError(
                    f"{_FIELD}: precompute_float8_dynamic_scale_for_fsdp=True needs "
                    f"enable_fsdp_float8_all_gather=True (the precomputed scales are those of the float8 "
                    f"all-gathered weights). Set enable_fsdp_float8_all_gather=true or "
                    f"precompute_float8_dynamic_scale_for_fsdp=false"
                )
            if AUTO_FILTER_SMALL_KN in self.filter_fqns and self.recipe_name == "rowwise_with_gw_hp":
                raise ValueError(
                    f"{_FIELD}.filter_fqns: {AUTO_FILTER_SMALL_KN!r} has no size rule for recipe_name="
                    f"'rowwise_with_gw_hp' (torchao defines them for tensorwise and rowwise only). Remove it and "
                    f"list small layers in filter_fqns, or use recipe_name='rowwise'"
                )

    config: Float8LinearConverter.Config

    def __init__(self, config: Float8LinearConverter.Config, *, context: ConversionContext) -> None:
        super().__init__(config, context=context)
        self.fsdp_sharded = context.fsdp_sharded
        self.fsdp_float8_all_gather = config.enable_fsdp_float8_all_gather and self.fsdp_sharded
        self.precompute_scales = config.precompute_float8_dynamic_scale_for_fsdp and self.fsdp_sharded
        if config.enable_fsdp_float8_all_gather and not self.fsdp_sharded:
            both = config.precompute_float8_dynamic_scale_for_fsdp
            logger.warning("%s: enable_fsdp_float8_all_gather%s no effect without FSDP sharding; ignoring", _FIELD,
                           " and precompute_float8_dynamic_scale_for_fsdp have" if both else " has")
        self._check_precision()
        self._check_compile()
        self._check_hardware()
        # torchao is imported when a converter is built, never by inspection commands (--help, --list-configs).
        from torchao.float8 import Float8LinearConfig

        # A fresh torchao config; our own config object is never modified.
        self.float8_config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(config.recipe_name),
            enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather,
            emulate=config.emulate or self._cpu_emulation_needed(),
        )

    # ----------------------------------------------------------------------------------------------
    # Cross-section rules

    def _check_precision(self) -> None:
        param_dtype = self.context.param_dtype
        dtype_name = str(param_dtype).removeprefix("torch.")
        recipe = self.config.recipe_name
        if param_dtype == torch.float16 and recipe != "tensorwise":
            raise ValueError(
                f"{_FIELD}.recipe_name={recipe!r} cannot be combined with precision.param_dtype=float16: the "
                f"rowwise FP8 GEMM writes only bfloat16, so torchao computes each float16 Linear output in "
                f"bfloat16 and casts it to float16, which gives the output bfloat16's precision and float16's "
                f"range (inf above 65504). Use precision.param_dtype=bfloat16 (every FP8-capable GPU has it "
                f"natively, and it needs no loss scaling) or recipe_name='tensorwise'"
            )
        if param_dtype == torch.float16:
            logger.warning("FP8 with precision.param_dtype=float16 trains with loss scaling, but every FP8-capable "
                           "GPU supports bfloat16, which needs none; prefer precision.param_dtype=bfloat16")
        if recipe == "rowwise_with_gw_hp" and self.context.device_type == "cpu" and self.context.autocast:
            raise ValueError(
                f"{_FIELD}.recipe_name='rowwise_with_gw_hp' fails on CPU without FSDP when the run computes in "
                f"{dtype_name}: torchao's Float8Linear casts its input only under CUDA autocast, so under CPU "
                f"autocast the high-precision weight-gradient matmul mixes a float32 input with {dtype_name} "
                f"gradients. Use FSDP (parallelism.dp_shard > 1), precision.param_dtype=float32, or "
                f"recipe_name='rowwise'"
            )

    def _check_compile(self) -> None:
        # The advice is about speed on FP8 tensor cores. On a CPU (no FP8 matrix units) or emulated, FP8 checks
        # numerics and is slower than BF16 with or without compile, so the warning would not be true there.
        if self.context.device_type != "cuda" or self.config.emulate:
            return
        if not self.context.compile_model:
            logger.warning(
                "FP8 training without torch.compile of the model is usually slower than BF16: the float8 "
                "casts and amax/scale computations run as separate eager kernels. Set compile.enable=true "
                "(with 'model' in compile.components) for speed"
            )

    def _cpu_emulation_needed(self) -> bool:
        reason = float8_recipe_needs_emulation(self.config.recipe_name, self.context.device_type)
        if reason is not None and not self.config.emulate:
            logger.warning("%s: %s", _FIELD, reason)
        return reason is not None

    def _check_hardware(self) -> None:
        if self.config.emulate:
            logger.info("%s.emulate=True: FP8 numerics emulated in high precision (for testing; slower than BF16)",
                        _FIELD)
            return
        if self.context.device_type == "cpu" and (note := replacement_note()) is not None:
            logger.info("%s: %s", _FIELD, note)
        if self.context.device_type != "cuda" or not torch.cuda.is_available():
            return  # torch._scaled_mm has a CPU implementation; a GPU job sized from a login node is not checked
        capability = torch.cuda.get_device_capability()
        if capability < MIN_FP8_CAPABILITY:
            raise ValueError(
                f"{_FIELD}: {torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]}) has "
                f"no FP8 tensor cores (needs {MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}+, Ada or Hopper). "
                f"Set {_FIELD}.emulate=true to emulate FP8 numerics (slower than BF16), or remove the float8 converter"
            )

    # ----------------------------------------------------------------------------------------------
    # The recipe's part of LinearQuantizer

    def swap(self, model: nn.Module, planned: set[str]) -> None:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=self.float8_config,
                                   module_filter_fn=lambda _module, fqn: fqn in planned)

    def post_optimizer_hook(self, model_parts: Sequence[nn.Module]) -> None:
        """Refresh the float8 scales of FSDP-sharded weights (one batched amax all-reduce per part)."""
        if not self.precompute_scales:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    def settings(self) -> str:
        cfg = self.config

        def state(active: bool, requested: bool) -> str:
            return "on" if active else ("off (no FSDP sharding)" if requested else "off")

        rowwise = self.fsdp_sharded and cfg.recipe_name != "tensorwise"
        return (f"recipe {cfg.recipe_name}, FSDP float8 all-gather "
                f"{state(self.fsdp_float8_all_gather, cfg.enable_fsdp_float8_all_gather)}"
                f"{f' ({ROWWISE_GATHERS_HIGH_PRECISION})' if rowwise else ''}, precomputed scales "
                f"{state(self.precompute_scales, cfg.precompute_float8_dynamic_scale_for_fsdp)}"
                f"{', emulated' if cfg.emulate else ''}")

    @property
    def casts_master_weight(self) -> bool:
        # Float8Linear casts its own high-precision weight (torchao's float8 casts run outside autocast).
        return True

    @property
    def all_gather_itemsize(self) -> int | None:
        return 1 if self.fsdp_float8_all_gather else None

    @property
    def all_gather_why(self) -> str:
        if self.fsdp_float8_all_gather:
            return "float8 with one tensorwise scale (all-reduced amax)"
        if self.config.recipe_name != "tensorwise":
            return f"{self.config.recipe_name}: {ROWWISE_GATHERS_HIGH_PRECISION}"
        return "enable_fsdp_float8_all_gather=false"

    @property
    def float8_tp_communication(self) -> bool:
        # One scale per tensor: a float8 activation can be gathered across TP ranks and stay valid.
        return self.config.recipe_name == "tensorwise"
